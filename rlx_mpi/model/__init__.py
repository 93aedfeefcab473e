"""What a model is to the core: the family contract (`stage`), the HDF5 checkpoint, the KV
cache a stage keeps, and the price of a step (`cost`: bytes, FLOPs, memory).

Imports: base, lifecycle, comm, kernels."""

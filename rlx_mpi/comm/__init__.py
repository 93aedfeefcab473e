"""Moving bytes between ranks: point-to-point with deadlines (`transport`), the tensor-parallel
all-reduce (`collectives`), wire codecs, the schedule as data and its executor, the rank grid
(`topology`), replica work sharing, and the one registry of MPI tags (`tags`).

Imports: base, lifecycle, kernels (bit casts)."""

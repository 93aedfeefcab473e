"""Rows through steps, as pure data (no MPI): the request record and the step batch
(`records`), the scheduler and its admission path, the prefix cache's block pool, sampling,
and the ring loop that generate and score share.

Imports: base, model, kernels."""

"""The life of one launched rank: the pre-MPI supervisor and its watcher, MPI start and end
under deadlines (`launch`), faults and agreed errors, stop signals, per-rank logs, progress.

Imports: the base modules (errors, rules, config, outputs) only."""

"""Training: the train step and its backends (HF, Megatron), HF <-> Megatron weight conversion,
the cell training loop, dynamic data parallelism, prefix communication groups, weight snapshots and
the supervised format warm-start."""

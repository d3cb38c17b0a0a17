"""Training: the train step and its backends (HF, Megatron), HF <-> Megatron weight conversion,
the cell training loop, dynamic data parallelism, prefix communication groups, weight snapshots and
the supervised format warm-start.

* :mod:`gyre.training.step` -- one step over micro-steps (the interface, the optimizer settings);
  :mod:`gyre.training.backends` builds the step ``--training-backend`` asks for:
  :mod:`gyre.training.hf_step` (``transformers``) or :mod:`gyre.training.megatron_step` (a
  megatron-core ``GPTModel`` of :mod:`gyre.training.megatron_model`, core attention of
  :mod:`gyre.training.attention`, run as a policy by :mod:`gyre.training.megatron_policy`, its
  weights gathered in HF layout by :mod:`gyre.training.megatron_export`; megatron-core itself
  imported by :mod:`gyre.training.megatron_import`, its import-time ``torch.compile`` deferred);
  :mod:`gyre.training.logprobs` -- target-token log-probs in chunks;
* :mod:`gyre.training.checkpoint_conversion` -- Qwen3 weights between HF and Megatron;
* :mod:`gyre.training.control` -- the typed control messages between rank 0 and the cells;
* :mod:`gyre.training.cell` -- a cell's role transitions (paper §4.3);
* :mod:`gyre.training.streaming` and :mod:`gyre.training.prefix_groups` -- streaming training
  with dynamic membership (paper §4.4); :mod:`gyre.training.weight_snapshot` -- the core's weight
  snapshots that joining satellites pull;
* :mod:`gyre.training.warmstart` -- the supervised format warm-start.
"""

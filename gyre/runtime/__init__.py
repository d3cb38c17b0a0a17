"""The main job's runtime: every rank's cell loop, rank 0's controller, start-up and resume.

* :mod:`gyre.runtime.pretrain` -- ``pretrain(args)``, called by ``pretrain_gyre.py``; its parts
  :mod:`gyre.runtime.job_checks` (the checks before start-up), :mod:`gyre.runtime.rank_setup`
  (a rank's process group, the TCPStore, SGLang cell servers), :mod:`gyre.runtime.rank0` (rank 0's
  proxy, standalone pool and controller) and :mod:`gyre.runtime.progress` (the console bar);
  :mod:`gyre.runtime.config` -- the typed configuration of the two shells below;
* :mod:`gyre.runtime.pipeline` -- one function per arrow of the pipeline (docs/architecture.md);
* :mod:`gyre.runtime.controller` -- the scheduler's shell on rank 0, with
  :mod:`gyre.runtime.executions` (the table of executions), :mod:`gyre.runtime.accounting`
  (statistics, role changes, the summary), :mod:`gyre.runtime.checkpointing` (save, resume) and
  :mod:`gyre.runtime.carry_over` (what a resumed run takes over);
* :mod:`gyre.runtime.cell_worker` -- a cell's engine, training replica and control loop;
  :mod:`gyre.runtime.cell_group` -- the ranks of one cell; :mod:`gyre.runtime.gpu_cells` -- a
  cell's GPUs and its SGLang server (``--backend gpu``);
* :mod:`gyre.runtime.standalone` -- the rollout-only engines of ``--standalone-engines``;
* :mod:`gyre.runtime.plot` -- reward curve and role timeline of a run directory.
"""

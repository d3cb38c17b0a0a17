"""The main job's runtime: every rank's cell loop, rank 0's controller, start-up and resume.

* :mod:`gyre.runtime.pretrain` -- ``pretrain(args)``, called by ``pretrain_gyre.py``;
* :mod:`gyre.runtime.controller` -- the scheduler's shell on rank 0;
* :mod:`gyre.runtime.cell_worker` -- a cell's engine, training replica and control loop;
* :mod:`gyre.runtime.plot` -- reward curve and role timeline of a run directory.
"""

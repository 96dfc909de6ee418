"""The main job, from its plan to its report (``stepmem run``, ``python -m collector.job``):

* :mod:`.job` — :func:`~.job.plan_job` (every job-level check, once; the sampler's options
  resolved) and :func:`~.job.run_job`, the job's result;
* :mod:`.ray_session` — Ray's lifetime for a job or the daemon: connect or start a loopback
  cluster, signals as interrupts;
* :mod:`.session` — everything of one run on a connected cluster and its one teardown
  (:class:`~.session.RunSession`): samplers, runner, outbox, store, targets;
* :mod:`.runners` — what runs under the probe (the built-in workload, Ray Train workers, a
  script, a command, a replay);
* :mod:`.drain` — the run store filled from the samplers while the run goes on.
"""

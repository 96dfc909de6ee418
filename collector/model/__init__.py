"""The ground floor: the vocabulary every wing of stepmem speaks.

* :mod:`.units` — ``KIB``…``GIB`` and the one way a figure is written (``gib``, ``size``);
* :mod:`.kinds` — what memory holds (:class:`~.kinds.MemoryKind`: the probe's ledger kinds and
  the estimate's categories, one enum) and the account's components
  (:class:`~.kinds.Component`);
* :mod:`.records` — the typed records that cross boundaries: NVML readings, step events,
  sampler identity; :mod:`.step` — a joined step (:class:`~.step.StepRecord`) with its phase
  and per-process readings, validating itself when read from untrusted data;
* :mod:`.account` — every byte of one step's end, and its within-step peak split;
* :mod:`.series` — the per-step series every exporter reads off a record;
* :mod:`.prediction` — the estimate a run is held against (its file format);
* :mod:`.settings`, :mod:`.errors` — sampling and export settings; the error types.

Nothing here imports another part of ``collector`` (a contract test holds it), nor torch or
Ray: the training process's probe, the sampler actors and the run readers all import it.
"""

"""``stepmem estimate``: a training step's memory predicted before it runs.

* :mod:`.spec` — what is estimated (:class:`~.spec.Spec`: a model, an optimizer, a batch and
  the loop), the shapes and optimizers stepmem knows, a machine's defaults, a config read as data;
* :mod:`.build` — the model, optimizer and sharding the trace runs, on the fake device;
* :mod:`.trace` — the trace itself, under fake tensors and torch's own tracker
  (:func:`~.trace.estimate`);
* :mod:`.render` — the estimate as text.

The result is a :class:`collector.model.prediction.Estimate` (the file ``--out`` writes, which the
probe and ``report --estimate`` read); :mod:`collector.analysis.reconcile` holds it against a
measured run.
"""

from collector.estimate.render import render
from collector.estimate.spec import OPTIMS, SHAPES, SHARDS, Spec
from collector.estimate.trace import estimate

__all__ = ["OPTIMS", "SHAPES", "SHARDS", "Spec", "estimate", "render"]

"""``stepmem estimate``: a training step's memory predicted before it runs.

Planned, then run (the job's shape: :func:`collector.run.job.plan_job`):

* :mod:`.request` — the flags planned once into an :class:`~.request.EstimateRequest`: every
  default and check, the card, the search; the file a script's child reads (both paths);
* :mod:`.run` — the entry: :func:`~.run.run_estimate` dispatches a request (both paths).

What is estimated:

* :mod:`.spec` — a model, an optimizer, a batch and the loop (:class:`~.spec.Spec`), the shapes
  and optimizers stepmem knows, a machine's defaults, a config read as data (config);
* :mod:`.build`, :mod:`.lora` — the model, optimizer, adapters and sharding the config path
  traces, on the fake device (config);
* :mod:`.script` — a user's script, unchanged, in a child process (script; a leaf: only
  :mod:`.run` imports it).

The trace:

* :mod:`.trace` — the config path's two steps under fake tensors (config);
* :mod:`.tracing` — the core below both: tracker kinds and module peaks, the allocation log held
  through the allocator model per step (both);
* :mod:`.fakes`, :mod:`.swap` — the fake-tensor toolkit (both); :mod:`.tracker` — torch's
  ``MemTracker`` as stepmem uses it (both); :mod:`.cuda_rules` — CUDA's autocast, attention and
  dropout rules on the CPU stand-in (both).

After the trace:

* :mod:`.alloc_log` — the ordered allocation/free log and its simulation; :mod:`.allocator`,
  :mod:`.allocator_config` — PyTorch's caching allocator, modelled from its source;
* :mod:`.gpus`, :mod:`.fit`, :mod:`.largest` — cards, whether a step fits, the largest size that
  does; :mod:`.calibrate` — a GPU's outside-torch figure measured (``devices --calibrate``);
* :mod:`.render` — the estimate as text.

The result is a :class:`collector.model.prediction.Estimate` (the file ``--out`` writes, which the
probe and ``report --estimate`` read); :mod:`collector.analysis.predicted_vs_measured` holds it
against a measured run.
"""

from collector.estimate.render import render
from collector.estimate.spec import OPTIMS, SHAPES, SHARDS, Spec
from collector.estimate.trace import estimate

__all__ = ["OPTIMS", "SHAPES", "SHARDS", "Spec", "estimate", "render"]

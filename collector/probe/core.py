"""The framework-neutral step probe: one core every adapter (HF, plain loop, Ray Train) calls.

What a *step* is: whatever the caller brackets with :meth:`StepProbe.begin` / :meth:`StepProbe.end`.
The adapters use one optimizer update (all micro-batches of a gradient-accumulation cycle, the
optimizer step and ``zero_grad``) as one step.

At each mark, for every CUDA device the process uses, the probe reads
``torch.cuda.memory_stats(d)`` (the keys in :data:`TORCH_KEYS`) and ``torch.cuda.mem_get_info(d)``,
then resets torch's peak statistics so the next interval has its own peaks. That reset is
process-wide per device, so the probe keeps what it took (:mod:`collector.probe.peaks`): the
user's own ``max_memory_allocated()``, ``memory_stats()`` and ``memory_summary()`` still show the
peak since the user's own reset, as without the probe. ``reset_peaks=False`` leaves torch's
counters untouched (the probe's peaks are then since the last reset by anyone).

At ``end`` it also takes a ledger per device (bytes): ``parameters``, ``gradients``,
``optimizer_state`` (optimizer state tensors on that device), ``optimizer_state_managed``
(bitsandbytes paged state: CUDA managed memory wrapped in CPU tensors marked ``is_paged``; the torch
allocator never sees it), and ``other_allocated`` (allocated − parameters − gradients −
optimizer_state: activations, temporaries, caches).

Latency impact: ``memory_stats`` costs ≈150 µs a call on an H200, ``mem_get_info`` ≈10 µs; a
begin/end pair is about 0.35 ms per device, plus ≈0.15 ms per phase mark. Events leave through
:class:`collector.probe.outbox.Outbox`, which never blocks: a Ray actor call is submitted and its
result ignored.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from collector.model import marks
from collector.model.kinds import LEDGER_KINDS, LIVE_KINDS, LedgerFigure, MemoryKind
from collector.model.prediction import Estimate, load_estimate
from collector.model.records import ERROR_PREFIX, Stat, StepEvent
from collector.model.series import SERIES
from collector.model.units import GIB
from collector.probe.identity import (
    allocator_mode,
    cpu_stands_in_for,
    cuda_uuid,
    distributed_identity,
)
from collector.probe.ledger import LedgerCache, UnshardWatch
from collector.probe.outbox import Outbox, RaySamplers
from collector.probe.peaks import user_peaks
from collector.probe.recording import HISTORY_STEPS, AllocationHistory

__all__ = ["TORCH_KEYS", "StepProbe", "cuda_uuid"]

log = logging.getLogger(__name__)

TORCH_KEYS = (
    Stat.ALLOCATED,
    Stat.ALLOCATED_PEAK,
    Stat.RESERVED,
    Stat.RESERVED_PEAK,
    Stat.ACTIVE,
    Stat.ACTIVE_PEAK,
    Stat.INACTIVE_SPLIT,
    Stat.INACTIVE_SPLIT_PEAK,
    Stat.SEGMENTS,
    Stat.RETRIES,
    Stat.OOMS,
    Stat.DEVICE_ALLOCS,
    Stat.DEVICE_FREES,
)
_PATHS = [(k, tuple(k.split("."))) for k in TORCH_KEYS]
CPU = "cpu"
RECORDS_KEPT = 20_000
EVENTS_ENV = "STEPMEM_EVENTS"  # a JSONL file every probe event is appended to (``stepmem capture``)
ESTIMATE_ENV = "STEPMEM_ESTIMATE"  # an estimate (JSON) whose predicted peak each end event carries
HISTORY_ENV = "STEPMEM_HISTORY_DIR"  # where allocation history snapshots go (see StepProbe)
_LOG_PEAKS = (Stat.ALLOCATED_PEAK, Stat.RESERVED_PEAK)
# The step's sequence number, one series per process: two probes in one process (train then
# evaluate, a notebook cell run again) never give two steps the same key. next() on a count is
# atomic under the GIL.
_SEQ = itertools.count(1)


def _never_raises(method: Callable[..., Any]) -> Callable[..., Any]:
    """A probe call the training loop makes: a bug in stepmem is counted
    (``errors["internal:<type>"]``) and logged once, never raised into training."""
    import functools

    @functools.wraps(method)
    def inner(self: StepProbe, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            key = f"internal:{type(exc).__name__}"
            if not self.errors[key]:
                log.exception("stepmem: the probe's %s failed (training goes on)", method.__name__)
            self.errors[key] += 1
            return None

    return inner


def _dig(nested: dict[str, Any], path: tuple[str, ...], missing: Any = None) -> Any:
    """The value at ``path`` of torch's nested statistics (``missing``: a key this torch lacks)."""
    node: Any = nested
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return missing
        node = node[part]
    return node


class StepProbe:
    """Reads allocator statistics at step marks for every CUDA device this process uses.

    ``devices``: CUDA indices to read (default, decided at the first ``begin``: in a distributed
    run — torch.distributed initialized, or ``WORLD_SIZE`` > 1 — only this rank's device,
    ``LOCAL_RANK`` or the current device, so that no rank opens a CUDA context on its
    neighbours' GPUs; otherwise every visible device, as a ``device_map="auto"`` model spreads
    over all of them). Every event carries the step's sequence number (``seq``: 1, 2, 3, …,
    whatever numbers the caller gives), the process's pid, and its rank and world size
    (:func:`distributed_identity`, read at each begin until the process group exists). Use
    :meth:`watch` to give it the model and optimizer for the ledger. ``gpu_uuids`` overrides the
    UUID each device's events are addressed to (used to point a CPU-only run at replayed GPUs).
    ``events_file`` (default: the ``STEPMEM_EVENTS`` environment variable) receives every event
    as a JSON line. ``history_dir`` (default: ``STEPMEM_HISTORY_DIR``; none: off) receives
    PyTorch's allocation history with Python stacks for the first ``history_steps`` steps and a
    snapshot on out-of-memory (:class:`collector.probe.recording.AllocationHistory`). Each begin
    event also carries the process's pid and the allocator's mode (:func:`allocator_mode`).
    ``estimate`` (default: ``STEPMEM_ESTIMATE``; a ``stepmem estimate --out`` file or its
    :class:`collector.model.prediction.Estimate`) puts the predicted allocated peak in each end
    event (``estimate_peak``; exported as ``stepmem_step_estimate_peak_bytes``) when the probe
    watches a model; an unreadable file is counted in ``errors`` and training goes on.
    """

    def __init__(
        self,
        devices: list[int] | None = None,
        *,
        outbox: Outbox | None = None,
        reset_peaks: bool = True,
        gpu_uuids: dict[Any, str] | None = None,
        events_file: str | Path | None = None,
        history_dir: str | Path | None = None,
        history_steps: int = HISTORY_STEPS,
        clock: Callable[[], int] = time.monotonic_ns,
        estimate: Any = None,
    ) -> None:
        if events_file is None:
            events_file = os.environ.get(EVENTS_ENV) or None
        if history_dir is None:
            history_dir = os.environ.get(HISTORY_ENV) or None
        self.history = AllocationHistory(Path(history_dir), history_steps) if history_dir else None
        self.outbox = outbox or Outbox(RaySamplers(), events_file=events_file)
        self.reset_peaks = reset_peaks
        self.model: Any = None
        self.optimizer: Any = None
        self.step_index: int | None = None
        # per step per device, for the caller: the newest RECORDS_KEPT
        self.records: deque[dict[str, Any]] = deque(maxlen=RECORDS_KEPT)
        self.errors: Counter[str] = Counter()
        self.cost_ns: list[int] = []  # probe time per step (begin+phases+end), all devices
        self._clock = clock
        self._devices_arg = devices
        self._devices: list[Any] | None = None
        self._uuids: dict[Any, str] = dict(gpu_uuids or {})
        self._cuda = False
        self._step_cost = 0
        self._begin_t = 0
        self._baseline: dict[Any, int] = {}
        self._mode: dict[str, int] = {}
        self._ledger_cache = LedgerCache()
        self._unshard: UnshardWatch | None = None
        self.seq = 0  # the probe's own number of the current (or last) step
        self._pid = os.getpid()
        self._rank, self._world, self._dist_known = 0, 1, False
        self._end_reserved: int | None = None  # torch reserved at the last end, all devices
        self._log_peaks: dict[Any, dict[str, int]] = {}  # per device, since the last metrics()
        self._last_end: dict[Any, dict[str, Any]] = {}  # per device, its newest end record
        self.estimate_peak = self._estimate_peak(estimate or os.environ.get(ESTIMATE_ENV) or None)

    def _estimate_peak(self, estimate: Any) -> int | None:
        if estimate is None:
            return None
        try:
            est = estimate if isinstance(estimate, Estimate) else load_estimate(Path(estimate))
            return est.peak
        except Exception as exc:  # a bad file costs the training job nothing: counted, said once
            self.errors[f"estimate:{type(exc).__name__}"] += 1
            log.warning("stepmem probe: estimate %s not used (%s)", estimate, exc)
            return None

    # -- set-up ------------------------------------------------------------------------------

    def watch(self, model: Any = None, optimizer: Any = None) -> StepProbe:
        """Give the probe the model and optimizer whose tensors the ledger counts (an FSDP2
        model's local shards, a DDP model's gradient buckets: :mod:`collector.probe.ledger`)."""
        listener = marks.listening()
        if listener is not None:  # an estimate runs this script: the model is its business
            listener.watch(model, optimizer)
            return self
        if model is not None and model is not self.model:
            self.model = model
            try:
                self._unshard = UnshardWatch(model)
            except Exception as exc:  # the ledger goes on without the unsharded peak
                self.errors[f"unshard_watch:{type(exc).__name__}"] += 1
                self._unshard = None
        if optimizer is not None:
            self.optimizer = optimizer
        return self

    def _setup(self) -> None:
        import torch

        self._cuda = torch.cuda.is_available()
        if not self._cuda:
            log.warning(
                "stepmem: CUDA is not available; the probe records step times and the "
                "CPU ledger only (no allocator statistics)"
            )
            self._devices = [CPU]
            # a CPU rank standing in for a GPU (tests, CI): its events address that GPU's sampler
            self._uuids.setdefault(CPU, cpu_stands_in_for() or "cpu")
            return
        idx = self._devices_arg
        if idx is None:
            idx = self._default_devices(torch)
        self._devices = list(idx)
        for d in self._devices:
            if d not in self._uuids:
                self._uuids[d] = cuda_uuid(d)
            # CUDA-context baseline: device memory in use that the allocator does not hold.
            free, total = torch.cuda.mem_get_info(d)
            self._baseline[d] = (total - free) - torch.cuda.memory_reserved(d)
        self._mode = allocator_mode()
        rank, world, _, _ = distributed_identity()
        if self.history is not None and world > 1 and rank != 0:
            self.history = None  # one rank's history tells the lines; all would collide
        if self.history is not None:
            self.history.attach_oom_observer(lambda: self.step_index)

    def _default_devices(self, torch: Any) -> list[int]:
        """Every visible device; in a distributed run only this rank's own."""
        count = torch.cuda.device_count()
        _, world, local, initialized = distributed_identity()
        if world > 1 or initialized:
            if local is not None and 0 <= local < count:
                return [local]
            return [torch.cuda.current_device()]
        return list(range(count))

    def _identify(self) -> None:
        """Rank and world size for this step's events; fixed once the process group exists."""
        if not self._dist_known:
            self._rank, self._world, _, self._dist_known = distributed_identity()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def devices(self) -> list[Any]:
        if self._devices is None:
            self._setup()
        assert self._devices is not None
        return self._devices

    def _cuda_ready(self) -> bool:
        return bool(self.devices) and self._cuda  # set-up first: CUDA found or not

    # -- reading -----------------------------------------------------------------------------

    def _read(self, d: Any) -> dict[str, int]:
        if not self._cuda:
            return {}
        import torch

        try:
            # torch's own figures (the user's view carries the peaks the probe's resets took:
            # collector.probe.peaks); the nested form skips memory_stats()'s flattening of ~100
            # keys in Python (most of its ≈150 µs)
            keeper = user_peaks() if self.reset_peaks else None
            read = keeper.real_stats if keeper else torch.cuda.memory_stats_as_nested_dict
            nested = read(d)
            out = {k: int(_dig(nested, path, 0)) for k, path in _PATHS}
            free, total = torch.cuda.mem_get_info(d)
            out[Stat.MEM_FREE], out[Stat.MEM_TOTAL] = int(free), int(total)
            out[Stat.CONTEXT_BASELINE] = self._baseline.get(d, 0)
            if keeper is not None:
                keeper.carry(d, nested)  # the user's max_memory_allocated() keeps its peak
                keeper.real_reset(d)
            elif self.reset_peaks:
                torch.cuda.reset_peak_memory_stats(d)
            return out
        except Exception as exc:  # a reading error must never fail training
            self.errors[type(exc).__name__] += 1
            log.debug("torch memory stats failed on %s: %s", d, exc)
            return {}

    def _ledger(self, step: int) -> dict[Any, dict[str, int]]:
        if self.model is None and self.optimizer is None:
            return {}
        import torch

        try:
            by_device = self._ledger_cache.take(self.model, self.optimizer, step)
        except Exception as exc:
            self.errors[type(exc).__name__] += 1
            return {}
        out = {}
        unsharded = self._unshard.take() if self._unshard and self._unshard.attached else None
        for d in self.devices:
            dev = torch.device("cpu") if d == CPU else torch.device("cuda", d)
            out[d] = by_device.get(dev, dict.fromkeys(LEDGER_KINDS, 0))
            if unsharded is not None:  # one device a rank under FSDP2
                out[d][LedgerFigure.UNSHARDED_PEAK] = unsharded
        return out

    def _mark(self, kind: str, step: int, phase: str = "") -> None:
        t0 = time.perf_counter_ns()
        ledgers = self._ledger(step) if kind == "end" else {}
        reserved = 0
        for d in self.devices:
            t = self._clock()
            torch_stats = self._read(d)
            if kind == "begin" and torch_stats:
                torch_stats.update(self._mode)
            led = ledgers.get(d, {})
            if led and Stat.ALLOCATED in torch_stats:
                led[MemoryKind.OTHER_ALLOCATED] = torch_stats[Stat.ALLOCATED] - sum(
                    led.get(k, 0) for k in LIVE_KINDS
                )
            ev = StepEvent(
                kind=kind,
                step=step,
                t_ns=t,
                gpu_uuid=self._uuids[d],
                phase=phase,
                torch=torch_stats,
                ledger=led,
                seq=self.seq,
                pid=self._pid,
                rank=self._rank,
                world_size=self._world,
                estimate_peak=self.estimate_peak if led else None,
            )
            d_ev = self.outbox.put(ev)
            if torch_stats:  # the allocator's peaks since the last metrics() (trackers)
                peaks = self._log_peaks.setdefault(d, {})
                for k in _LOG_PEAKS:
                    peaks[k] = max(peaks.get(k, 0), torch_stats.get(k, 0))
            if kind == "end":
                rec = {"device": str(d), "begin_ns": self._begin_t, **d_ev}
                self.records.append(rec)
                self._last_end[d] = rec
                reserved += torch_stats.get(Stat.RESERVED, 0)
        self._end_reserved = reserved if kind == "end" and self._cuda else None
        self._step_cost += time.perf_counter_ns() - t0

    # -- the step contract -------------------------------------------------------------------

    @_never_raises
    def begin(self, step: int) -> None:
        """Mark the start of step ``step``: the caller's number for it (it may restart each
        epoch; the probe numbers steps itself too, ``seq``, so none is lost or merged)."""
        if (listener := marks.listening()) is not None:
            return listener.begin(step)
        if self.step_index is not None:
            self.errors["begin_without_end"] += 1
        self.step_index = step
        self.seq = next(_SEQ)  # per process, whichever probe: a step's key is (GPU, pid, seq)
        self._identify()
        self._step_cost = 0
        self._begin_t = self._clock()
        if self._cuda_ready() and self.history is not None:  # set-up may turn history off
            self.history.begin(step)
        self._mark("begin", step)

    @_never_raises
    def phase(self, name: str) -> None:
        """Mark the start of a phase inside the current step (e.g. ``"optimizer"``). The peaks
        carried by this mark are those of the phase that just ended."""
        if (listener := marks.listening()) is not None:
            return listener.phase(name)
        if self.step_index is None:
            self.errors["phase_outside_step"] += 1
            return
        self._mark("phase", self.step_index, name)
        if self.history is not None:
            self.history.mark(self.step_index, "phase", name)

    @_never_raises
    def end(self) -> None:
        """Mark the end of the current step, take the ledger, and send what is due."""
        if (listener := marks.listening()) is not None:
            return listener.end()
        if self.step_index is None:
            self.errors["end_without_begin"] += 1
            return
        self._mark("end", self.step_index)
        if self.history is not None:
            self.history.end(self.step_index, self._end_reserved)
        self.step_index = None
        t0 = time.perf_counter_ns()
        self.outbox.maybe_flush()
        self.cost_ns.append(self._step_cost + time.perf_counter_ns() - t0)

    @_never_raises
    def fail(self, exc: BaseException | None = None) -> None:
        """End the current step as failed (the training step raised ``exc``, e.g. a CUDA OOM):
        its record is kept with the allocator's figures at the failure and ``error`` naming the
        exception, and everything batched is sent at once, before the process dies. Does
        nothing outside a step."""
        if (listener := marks.listening()) is not None:
            return listener.fail(exc)
        if self.step_index is None:
            return
        name = type(exc).__name__ if exc is not None else "error"
        self._mark("end", self.step_index, f"{ERROR_PREFIX}{name}")
        self.step_index = None
        self.outbox.drain()

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[StepProbe]:
        """``with probe.step(i): ...`` — begin, run the body, end (when the body raises, e.g.
        an OOM, the step is recorded as failed and the exception goes on)."""
        self.begin(step)
        try:
            yield self
        except BaseException as exc:
            self.fail(exc)
            raise
        self.end()

    def metrics(self) -> dict[str, float]:
        """Per-step memory for an experiment tracker (W&B, MLflow, TensorBoard, a plain
        ``print``), keys ``stepmem/...``, GiB; never waits. For the largest of this process's
        GPUs:

        * ``torch_allocated_peak_gib``, ``torch_reserved_peak_gib``: the allocator's peaks since
          the last call; ``torch_allocated_gib``, ``torch_reserved_gib`` at the last step's end;
        * ``ledger/<kind>_gib``: parameters, gradients, optimizer state at the last step's end
          (when the probe watches the model and optimizer); ``estimate_peak_gib``: the allocated
          peak an estimate predicted (a probe given one);
        * ``nvml_peak_gib``, ``nvml_end_gib`` and ``nvml_step``: the newest step the sampler
          has joined (its within-step NVML peak and end reading) and that step's number, which
          trails the training step by the join delay; absent until the first call has asked
          the sampler for it (the outbox's sender fetches it in the background; each call
          wakes it to collect the answer and ask again, so a call sees what the sampler had
          joined by about the previous one).
        """
        if marks.listening() is not None:
            return {}
        out: dict[str, float] = {}
        peaks, self._log_peaks = self._log_peaks, {}
        for key, name in zip(_LOG_PEAKS, ("allocated", "reserved"), strict=True):
            vals = [p[key] for p in peaks.values() if key in p]
            if vals:
                out[f"stepmem/torch_{name}_peak_gib"] = max(vals) / GIB
        last = self._last_end
        for key, name in (
            (Stat.ALLOCATED, "allocated"),
            (Stat.RESERVED, "reserved"),
        ):
            vals = [r["torch"][key] for r in last.values() if key in (r.get("torch") or {})]
            if vals:
                out[f"stepmem/torch_{name}_gib"] = max(vals) / GIB
        for kind in LEDGER_KINDS:
            vals = [r["ledger"][kind] for r in last.values() if kind in (r.get("ledger") or {})]
            if vals:
                out[f"stepmem/ledger/{kind}_gib"] = max(vals) / GIB
        if self.estimate_peak is not None and last:
            out["stepmem/estimate_peak_gib"] = self.estimate_peak / GIB
        self.outbox.want_newest = True
        self.outbox.wake()  # collect the answer to the last ask and ask again, on the sender
        joined = [r for r in self.outbox.newest.values() if r.measured]
        if joined:
            top = max(joined, key=lambda r: r.nvml_peak_bytes or 0)
            for row in SERIES:
                for _, v in row.values(top) if row.tracker else ():
                    scale = GIB if row.metric.unit == "bytes" else 1
                    out[f"stepmem/{row.tracker}"] = v / scale
        return out

    @_never_raises
    def close(self) -> None:
        """Send everything still batched. Call once when training ends."""
        if marks.listening() is not None:
            return
        self.outbox.close()

"""The framework-neutral step probe: one core every adapter (HF, plain loop, Ray Train) calls.

What a *step* is: whatever the caller brackets with :meth:`StepProbe.begin` / :meth:`StepProbe.end`.
The adapters use one optimizer update (all micro-batches of a gradient-accumulation cycle, the
optimizer step and ``zero_grad``) as one step.

At each mark, for every CUDA device the process uses, the probe reads
``torch.cuda.memory_stats(d)`` (the keys in :data:`TORCH_KEYS`) and ``torch.cuda.mem_get_info(d)``,
then calls ``torch.cuda.reset_peak_memory_stats(d)`` so the next interval has its own peaks.
**Conflict:** that reset is process-wide per device; anything else in the process that reads
``max_memory_allocated()`` (a framework's own logging, say) sees peaks since the probe's last mark,
not since its own reset. Pass ``reset_peaks=False`` to leave the counters alone (the probe's
peaks are then since the last reset by anyone).

At ``end`` it also takes a ledger per device (bytes): ``parameters``, ``gradients``,
``optimizer_state`` (optimizer state tensors on that device), ``optimizer_state_managed``
(bitsandbytes paged state: CUDA managed memory wrapped in CPU tensors marked ``is_paged``; the torch
allocator never sees it), and ``other_allocated`` (allocated − parameters − gradients −
optimizer_state: activations, temporaries, caches).

Latency impact: ``memory_stats`` costs ≈150 µs a call on an H200, ``mem_get_info`` ≈10 µs; a
begin/end pair is about 0.35 ms per device, plus ≈0.15 ms per phase mark. Events leave through
:class:`Outbox`, which never blocks: a Ray actor call is submitted and its result ignored.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from collector.records import ERROR_PREFIX, StepEvent

__all__ = ["TORCH_KEYS", "LedgerCache", "Outbox", "StepProbe", "cuda_uuid", "ledger"]

log = logging.getLogger(__name__)

TORCH_KEYS = (
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "reserved_bytes.all.current",
    "reserved_bytes.all.peak",
    "active_bytes.all.current",
    "active_bytes.all.peak",
    "inactive_split_bytes.all.current",
    "inactive_split_bytes.all.peak",
    "segment.all.current",
    "num_alloc_retries",
    "num_ooms",
    "num_device_alloc",
    "num_device_free",
)
_PATHS = [(k, tuple(k.split("."))) for k in TORCH_KEYS]
CPU = "cpu"
EVENTS_KEPT = 200_000
RECORDS_KEPT = 20_000
EVENTS_ENV = "STEPMEM_EVENTS"  # a JSONL file every probe event is appended to (``stepmem capture``)
HISTORY_ENV = "STEPMEM_HISTORY_DIR"  # where allocation history snapshots go (see StepProbe)
HISTORY_STEPS = 3  # steps recorded with allocation stacks when a history folder is given
HISTORY_MAX_ENTRIES = 200_000  # trace entries PyTorch keeps (a ring); older ones are dropped
_LOG_PEAKS = ("allocated_bytes.all.peak", "reserved_bytes.all.peak")
GIB = 1 << 30
HISTORY_JUMP_BYTES = 256 << 20  # a jump of torch reserved this large gets its next step recorded
HISTORY_JUMPS = 2  # steps recorded after jumps, at most, in a run


def allocator_mode() -> dict[str, int]:
    """How this process's CUDA caching allocator is set up, from the environment PyTorch reads:
    caching off (``PYTORCH_NO_CUDA_MEMORY_CACHING``: every free goes back to the driver and the
    allocator's statistics stay 0) and expandable segments (``PYTORCH_CUDA_ALLOC_CONF`` or
    ``PYTORCH_ALLOC_CONF`` with ``expandable_segments:True``)."""
    names = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    conf = ",".join(os.environ.get(k, "") for k in names)
    conf = conf.replace(" ", "").lower()
    no_cache = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "")
    return {
        "process_pid": os.getpid(),
        "allocator_caching_disabled": int(no_cache not in ("", "0")),
        "allocator_expandable_segments": int("expandable_segments:true" in conf),
    }


def _dig(nested: dict[str, Any], path: tuple[str, ...]) -> Any:
    for part in path:
        nested = nested[part]
    return nested


def cuda_uuid(device: int) -> str:
    """NVML-style UUID (``GPU-…``) of CUDA device ``device`` as this process numbers it."""
    import torch

    raw = str(torch.cuda.get_device_properties(device).uuid)
    return raw if raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


LEDGER_KINDS = ("parameters", "gradients", "optimizer_state", "optimizer_state_managed")


def ledger(model: Any = None, optimizer: Any = None) -> dict[Any, dict[str, int]]:
    """Bytes of parameters, gradients and optimizer state, per ``torch.device`` they live on.

    Paged (managed) bitsandbytes state — CPU tensors marked ``is_paged`` — is attributed to
    ``cuda:<page_deviceid>`` under ``optimizer_state_managed``. Tensors are deduplicated by data
    pointer. One full pass over every tensor: see :class:`LedgerCache` for the per-step cost.
    """
    import torch

    out: dict[Any, dict[str, int]] = {}
    seen: set[int] = set()

    def add(device: Any, kind: str, t: Any) -> None:
        ptr = t.data_ptr()
        if ptr in seen:
            return
        seen.add(ptr)
        out.setdefault(device, dict.fromkeys(LEDGER_KINDS, 0))[kind] += _nbytes(t)

    if model is not None:
        for p in model.parameters():
            add(p.device, "parameters", p)
            if p.grad is not None:
                add(p.grad.device, "gradients", p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if not isinstance(v, torch.Tensor):
                    continue
                if getattr(v, "is_paged", False):
                    dev = torch.device("cuda", getattr(v, "page_deviceid", 0) or 0)
                    add(dev, "optimizer_state_managed", v)
                else:
                    add(v.device, "optimizer_state", v)
    return out


class LedgerCache:
    """The ledger at a per-step cost of one attribute check per parameter.

    A full :func:`ledger` pass over a 7B model with 8-bit optimizer state touches ~2,000 tensors
    (≈6 ms on the H200 host). Parameter and optimizer-state inventories change when state is
    created (the first ``optimizer.step()``), so the full pass is redone only when
    ``len(optimizer.state)`` changes, or every ``refresh_steps`` steps. Per step, gradients are
    counted from cached parameter sizes for
    every parameter whose ``.grad`` is set (gradients have their parameter's size and device).
    """

    def __init__(self, refresh_steps: int = 100) -> None:
        self.refresh_steps = refresh_steps
        self.full_passes = 0
        self._n_state: int | None = None
        self._taken_at = 0
        self._static: dict[Any, dict[str, int]] = {}
        self._params: list[tuple[Any, Any, int]] = []

    def take(self, model: Any, optimizer: Any, step: int) -> dict[Any, dict[str, int]]:
        n_state = len(optimizer.state) if optimizer is not None else 0
        if n_state != self._n_state or step - self._taken_at >= self.refresh_steps:
            self._static = ledger(model, optimizer)
            self._params = (
                [(p, p.device, _nbytes(p)) for p in model.parameters()] if model is not None else []
            )
            self._n_state = n_state
            self._taken_at = step
            self.full_passes += 1
            for led in self._static.values():
                led["gradients"] = 0
        out = {dev: dict(led) for dev, led in self._static.items()}
        for p, dev, nbytes in self._params:
            if p.grad is not None:
                out.setdefault(dev, dict.fromkeys(LEDGER_KINDS, 0))["gradients"] += nbytes
        return out


class Outbox:
    """Batches step events per GPU and sends them from a background thread; keeps every event.

    The training thread only appends (:meth:`put`, a dict append under a lock) and nudges
    (:meth:`maybe_flush`). A daemon sender thread does the rest off the hot path: every
    ``flush_interval_s``, or as soon as a GPU has ``batch_max`` events waiting, it writes the
    events to ``events_file`` (JSON lines) and submits ``handle.record_events.remote(batch)`` to
    the GPU's sampler, dropping the returned reference — nothing ever waits on an actor, and a Ray
    call that stalls stalls only the sender. A batch that cannot be submitted (no sampler, an
    unusable handle) is counted in ``dropped``; the events stay in ``events`` for the run store.
    """

    def __init__(
        self,
        resolve: Callable[[str], Any] | None,
        batch_max: int = 64,
        flush_interval_s: float = 0.5,
        events_file: str | Path | None = None,
    ) -> None:
        self._resolve = resolve
        self.batch_max = batch_max
        self.flush_interval_s = flush_interval_s
        # Every event until taken (take_events); at most EVENTS_KEPT are held, oldest dropped
        # and counted, so a long run without a run store cannot grow the training process.
        self.events: deque[dict[str, Any]] = deque()
        self.sent = 0
        self.dropped: Counter[str] = Counter()
        self._pending: dict[str, list[dict[str, Any]]] = {}
        self._unwritten: list[dict[str, Any]] = []
        self._file = open(events_file, "a") if events_file else None  # noqa: SIM115
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        # The newest joined step record of each GPU, fetched by the sender thread once
        # something asked for it (:meth:`StepProbe.metrics`): never waited on.
        self.want_newest = False
        self.newest: dict[str, dict[str, Any]] = {}
        self._asks: dict[str, Any] = {}  # GPU → ObjectRef of a newest_record call in flight
        self._registered: set[str] = set()  # samplers told this process's Ray name

    def put(self, ev: StepEvent) -> dict[str, Any]:
        d = ev.to_dict()
        with self._lock:
            if len(self.events) >= EVENTS_KEPT:
                self.events.popleft()
                self.dropped["events_not_kept"] += 1
            self.events.append(d)
            self._pending.setdefault(ev.gpu_uuid, []).append(d)
            if self._file is not None:
                self._unwritten.append(d)
        if self._file is not None:
            # under `stepmem capture` the sender writes each mark at once: the capture takes
            # its per-process snapshot at the mark (an Event.set here, the write on the sender)
            self._wake.set()
        return d

    def take_events(self) -> list[dict[str, Any]]:
        """Every event kept so far, removed from the outbox (the run store calls this)."""
        with self._lock:
            out = list(self.events)
            self.events.clear()
        return out

    def maybe_flush(self) -> None:
        """Start the sender on first use; wake it early when a batch is full. Never blocks."""
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="stepmem-outbox", daemon=True)
            self._thread.start()
        if any(len(v) >= self.batch_max for v in self._pending.values()):
            self._wake.set()

    def wake(self) -> None:
        """Have the sender run now (started on first use). Never blocks."""
        self.maybe_flush()
        self._wake.set()

    def drain(self, timeout_s: float = 2.0) -> bool:
        """Wake the sender and wait up to ``timeout_s`` for everything pending to be sent (a
        failing step's last events, before the process dies). True when nothing is pending."""
        self.wake()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return True
            time.sleep(0.01)
        return False

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        """Write and send everything pending now (the sender thread calls this; so does close)."""
        with self._send_lock:
            with self._lock:
                pending, self._pending = self._pending, {}
                unwritten, self._unwritten = self._unwritten, []
            self._write(unwritten)
            for uuid, batch in pending.items():
                self._send(uuid, batch)
            if self.want_newest:
                self._ask_newest({e["gpu_uuid"] for b in pending.values() for e in b})

    def _ask_newest(self, sent_to: set[str]) -> None:
        """Collect the answers that have arrived (without waiting) and ask again, for every GPU
        this outbox sends to."""
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return
        for uuid in sent_to | set(self._asks):
            ref = self._asks.get(uuid)
            try:
                if ref is not None:
                    ready, _ = ray.wait([ref], timeout=0)
                    if not ready:
                        continue
                    rec = ray.get(ref, timeout=0)
                    if rec is not None:
                        self.newest[uuid] = rec
                handle = self._resolve(uuid) if self._resolve is not None else None
                self._asks[uuid] = handle.newest_record.remote() if handle is not None else None
            except Exception as exc:  # a tracker key missing costs nothing else
                self._asks[uuid] = None
                self.dropped["newest_record"] += 1
                log.debug("newest record from %s failed: %s", uuid, exc)

    def _write(self, events: list[dict[str, Any]]) -> None:
        if self._file is None or not events:
            return
        try:
            self._file.write("".join(json.dumps(d) + "\n" for d in events))
            self._file.flush()
        except OSError as exc:
            self.dropped["events_file"] += len(events)
            log.warning("step events file write failed: %s", exc)

    def _send(self, uuid: str, batch: list[dict[str, Any]]) -> None:
        handle = None
        if self._resolve is not None:
            try:
                handle = self._resolve(uuid)
            except Exception as exc:  # lookup trouble is the sampler's problem, not training's
                log.debug("sampler lookup for %s failed: %s", uuid, exc)
        if handle is None:
            self.dropped["no_sampler"] += len(batch)
            return
        try:
            handle.record_events.remote(batch)
            self.sent += len(batch)
            if uuid not in self._registered:  # once per sampler: who this process is
                handle.register_process.remote(os.getpid(), ray_process_label())
                self._registered.add(uuid)
        except Exception as exc:
            self.dropped["send_failed"] += len(batch)
            log.debug("sending %d events to %s failed: %s", len(batch), uuid, exc)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the sender and send what is left (bounded by ``timeout`` for the thread)."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


def ray_process_label() -> str:
    """This process's name in Ray, for the per-process memory series: a named actor's name,
    ``train_rank_<N>`` in a Ray Train worker, ``actor`` (unnamed), ``driver`` or ``task``.
    Bounded by the training processes of a GPU, unlike a pid."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return "driver"
    ctx = ray.get_runtime_context()
    if ctx.get_actor_id():
        if ctx.get_actor_name():
            return ctx.get_actor_name()
        train = sys.modules.get("ray.train")  # a Train worker has it imported; never import it
        try:
            return f"train_rank_{train.get_context().get_world_rank()}" if train else "actor"
        except Exception:  # an actor that is not a Train worker
            return "actor"
    return "driver" if ctx.worker.mode == ray.SCRIPT_MODE else "task"


class _RaySamplers:
    """Resolves a GPU UUID to this node's sampler, once the process is connected to Ray (a
    process that never imported Ray has no sampler to talk to). Each outbox owns one, with its
    own lookup cache."""

    def __init__(self) -> None:
        self._lookup: Any = None

    def __call__(self, uuid: str) -> Any:
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return None
        if self._lookup is None:
            from collector.lookup import SamplerLookup

            self._lookup = SamplerLookup()
        return self._lookup.find(uuid)


class StepProbe:
    """Reads allocator statistics at step marks for every CUDA device this process uses.

    ``devices``: CUDA indices to read (default: every visible device, read lazily at the first
    ``begin`` — a ``device_map="auto"`` model spreads over all of them). Use
    :meth:`watch` to give it the model and optimizer for the ledger. ``gpu_uuids`` overrides the
    UUID each device's events are addressed to (used to point a CPU-only run at replayed GPUs).
    ``events_file`` (default: the ``STEPMEM_EVENTS`` environment variable) receives every event
    as a JSON line. ``history_dir`` (default: ``STEPMEM_HISTORY_DIR``; none: off) receives
    PyTorch's allocation history with Python stacks for the first ``history_steps`` steps and a
    snapshot on out-of-memory (:class:`_History`). Each begin event also carries the process's
    pid and the allocator's mode (:func:`allocator_mode`).
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
    ) -> None:
        if events_file is None:
            events_file = os.environ.get(EVENTS_ENV) or None
        if history_dir is None:
            history_dir = os.environ.get(HISTORY_ENV) or None
        self.history = _History(Path(history_dir), history_steps) if history_dir else None
        self.outbox = outbox or Outbox(_RaySamplers(), events_file=events_file)
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
        self._end_reserved: int | None = None  # torch reserved at the last end, all devices
        self._log_peaks: dict[Any, dict[str, int]] = {}  # per device, since the last metrics()
        self._last_end: dict[Any, dict[str, Any]] = {}  # per device, its newest end record

    # -- set-up ------------------------------------------------------------------------------

    def watch(self, model: Any = None, optimizer: Any = None) -> StepProbe:
        """Give the probe the model and optimizer whose tensors the ledger counts."""
        if model is not None:
            self.model = model
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
            self._uuids.setdefault(CPU, "cpu")
            return
        idx = self._devices_arg
        if idx is None:
            idx = list(range(torch.cuda.device_count()))
        self._devices = list(idx)
        for d in self._devices:
            if d not in self._uuids:
                self._uuids[d] = cuda_uuid(d)
            # CUDA-context baseline: device memory in use that the allocator does not hold.
            free, total = torch.cuda.mem_get_info(d)
            self._baseline[d] = (total - free) - torch.cuda.memory_reserved(d)
        self._mode = allocator_mode()
        if self.history is not None:
            self.history.attach_oom_observer(lambda: self.step_index)

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
            # The nested form skips memory_stats()'s flattening of ~100 keys in Python (most of
            # its ≈150 µs).
            nested = torch.cuda.memory_stats_as_nested_dict(d)
            try:
                out = {k: int(_dig(nested, path)) for k, path in _PATHS}
            except (KeyError, TypeError):
                flat = torch.cuda.memory_stats(d)
                out = {k: int(flat.get(k, 0)) for k in TORCH_KEYS}
            free, total = torch.cuda.mem_get_info(d)
            out["mem_free_bytes"], out["mem_total_bytes"] = int(free), int(total)
            out["context_baseline_bytes"] = self._baseline.get(d, 0)
            if self.reset_peaks:
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
        for d in self.devices:
            dev = torch.device("cpu") if d == CPU else torch.device("cuda", d)
            out[d] = by_device.get(dev, dict.fromkeys(LEDGER_KINDS, 0))
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
            if led and "allocated_bytes.all.current" in torch_stats:
                led["other_allocated"] = torch_stats["allocated_bytes.all.current"] - (
                    led["parameters"] + led["gradients"] + led["optimizer_state"]
                )
            ev = StepEvent(
                kind=kind,
                step=step,
                t_ns=t,
                gpu_uuid=self._uuids[d],
                phase=phase,
                torch=torch_stats,
                ledger=led,
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
                reserved += torch_stats.get("reserved_bytes.all.current", 0)
        self._end_reserved = reserved if kind == "end" and self._cuda else None
        self._step_cost += time.perf_counter_ns() - t0

    # -- the step contract -------------------------------------------------------------------

    def begin(self, step: int) -> None:
        """Mark the start of step ``step`` (an integer that grows by one each step)."""
        if self.step_index is not None:
            self.errors["begin_without_end"] += 1
        self.step_index = step
        self._step_cost = 0
        self._begin_t = self._clock()
        if self.history is not None and self._cuda_ready():
            self.history.begin(step)
        self._mark("begin", step)

    def phase(self, name: str) -> None:
        """Mark the start of a phase inside the current step (e.g. ``"optimizer"``). The peaks
        carried by this mark are those of the phase that just ended."""
        if self.step_index is None:
            self.errors["phase_outside_step"] += 1
            return
        self._mark("phase", self.step_index, name)
        if self.history is not None:
            self.history.mark(self.step_index, "phase", name)

    def end(self) -> None:
        """Mark the end of the current step, take the ledger, and send what is due."""
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

    def fail(self, exc: BaseException | None = None) -> None:
        """End the current step as failed (the training step raised ``exc``, e.g. a CUDA OOM):
        its record is kept with the allocator's figures at the failure and ``error`` naming the
        exception, and everything batched is sent at once, before the process dies. Does
        nothing outside a step."""
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
          (when the probe watches the model and optimizer);
        * ``nvml_peak_gib``, ``nvml_end_gib`` and ``nvml_step``: the newest step the sampler
          has joined (its within-step NVML peak and end reading) and that step's number, which
          trails the training step by the join delay; absent until the first call has asked
          the sampler for it (the outbox's sender fetches it in the background; each call
          wakes it to collect the answer and ask again, so a call sees what the sampler had
          joined by about the previous one).
        """
        out: dict[str, float] = {}
        peaks, self._log_peaks = self._log_peaks, {}
        for key, name in zip(_LOG_PEAKS, ("allocated", "reserved"), strict=True):
            vals = [p[key] for p in peaks.values() if key in p]
            if vals:
                out[f"stepmem/torch_{name}_peak_gib"] = max(vals) / GIB
        last = self._last_end
        for key, name in (
            ("allocated_bytes.all.current", "allocated"),
            ("reserved_bytes.all.current", "reserved"),
        ):
            vals = [r["torch"][key] for r in last.values() if key in (r.get("torch") or {})]
            if vals:
                out[f"stepmem/torch_{name}_gib"] = max(vals) / GIB
        for kind in ("parameters", "gradients", "optimizer_state", "optimizer_state_managed"):
            vals = [r["ledger"][kind] for r in last.values() if kind in (r.get("ledger") or {})]
            if vals:
                out[f"stepmem/ledger/{kind}_gib"] = max(vals) / GIB
        self.outbox.want_newest = True
        self.outbox.wake()  # collect the answer to the last ask and ask again, on the sender
        joined = [r for r in self.outbox.newest.values() if r.get("nvml_peak_bytes") is not None]
        if joined:
            top = max(joined, key=lambda r: r["nvml_peak_bytes"])
            out["stepmem/nvml_peak_gib"] = top["nvml_peak_bytes"] / GIB
            if top.get("nvml_end_bytes") is not None:
                out["stepmem/nvml_end_gib"] = top["nvml_end_bytes"] / GIB
            out["stepmem/nvml_step"] = float(top["step"])
        return out

    def close(self) -> None:
        """Send everything still batched. Call once when training ends."""
        self.outbox.close()


class _History:
    """Which line allocated it: PyTorch's allocation history with Python stacks
    (``torch.cuda.memory._record_memory_history``) for the first ``steps`` steps, saved as one
    snapshot when they end (``history-steps-A-B.pickle``, open it in PyTorch's memory_viz) with
    the wall-clock time of each step mark (``marks.json``), so each allocation is placed in its
    step and phase. After that, when torch's reserved memory jumps by more than
    :data:`HISTORY_JUMP_BYTES` from one step's end to the next, the step after it is recorded
    too (``history-steps-N-N.pickle``; at most :data:`HISTORY_JUMPS` of them a run). And a
    snapshot when the allocator runs out of memory (``oom-step-N.pickle``). Between recordings
    nothing is recorded and the steps pay nothing. Never raises into training; what failed is
    counted in ``errors``."""

    def __init__(self, folder: Path, steps: int) -> None:
        self.folder, self.steps = folder, max(0, steps)
        self.first: int | None = None
        self.recording = False
        self.marks: list[dict[str, Any]] = []
        self.saved: list[str] = []
        self.errors: Counter[str] = Counter()
        self.cost_ns = 0  # time spent starting, snapshotting and stopping (not per allocation)
        self.window_done = self.steps == 0  # the first steps' recording is over
        self.jumps_left = HISTORY_JUMPS
        self.armed: int | None = None  # the step to record after a jump
        self.armed_jump = 0  # that jump, bytes
        self.recorded_from: int | None = None  # first step of the recording in progress
        self._reserved: int | None = None  # torch reserved at the last step's end

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn()
        except Exception as exc:  # history is an aid; training goes on without it
            self.errors[f"{what}:{type(exc).__name__}"] += 1
            log.debug("memory history %s failed: %s", what, exc)
            return None
        finally:
            self.cost_ns += time.perf_counter_ns() - t0

    def begin(self, step: int) -> None:
        if (self.first is None and self.steps) or (step == self.armed and not self.recording):
            if self.first is None:
                self.first = step
            self.armed = None

            def start() -> None:
                import torch

                self.folder.mkdir(parents=True, exist_ok=True)
                torch.cuda.memory._record_memory_history(
                    enabled="all", context="all", stacks="python", max_entries=HISTORY_MAX_ENTRIES
                )
                self.recording = True
                self.recorded_from = step

            self._guard("start", start)
        jump, self.armed_jump = self.armed_jump, 0
        self.mark(step, "begin", **({"after_jump": jump} if jump else {}))

    def mark(self, step: int, kind: str, phase: str = "", **extra: Any) -> None:
        if self.recording:
            self.marks.append(
                {
                    "step": step,
                    "kind": kind,
                    "phase": phase,
                    "wall_us": time.time_ns() // 1000,
                    **extra,
                }
            )

    def end(self, step: int, reserved: int | None = None) -> None:
        """``reserved``: torch's reserved bytes at this end (all devices), to find jumps."""
        jump = (
            reserved - self._reserved if reserved is not None and self._reserved is not None else 0
        )
        self._reserved = reserved if reserved is not None else self._reserved
        self.mark(step, "end", reserved_jump=jump)
        first = self.recorded_from
        if self.recording and first is not None:
            if not self.window_done and step >= first + self.steps - 1:
                self.window_done = True
                self._save_and_stop(first, step)
            elif self.window_done:  # the step after a jump
                self._save_and_stop(first, step)
        elif self.window_done and jump > HISTORY_JUMP_BYTES and self.jumps_left > 0:
            self.jumps_left -= 1
            self.armed, self.armed_jump = step + 1, jump  # record the next step

    def _save_and_stop(self, first: int, last: int) -> None:
        name = f"history-steps-{first}-{last}.pickle"
        self._guard("snapshot", lambda: self._save(name))
        self._guard("stop", self._stop)
        self.recorded_from = None

    def _stop(self) -> None:
        import torch

        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False

    def _save(self, name: str) -> None:
        import pickle

        import torch

        snap = torch.cuda.memory._snapshot()
        with open(self.folder / name, "wb") as f:
            pickle.dump(snap, f)
        (self.folder / "marks.json").write_text(json.dumps(self.marks))
        self.saved.append(name)

    def attach_oom_observer(self, current_step: Callable[[], int | None]) -> None:
        def observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
            step = current_step()
            self._guard("oom", lambda: self._save(f"oom-step-{step}.pickle"))

        def attach() -> None:
            import torch

            torch._C._cuda_attach_out_of_memory_observer(observer)

        self._guard("attach", attach)

"""The ordered allocations and frees of a traced step, as the caching allocator would receive
them, and what the allocator model (:mod:`.allocator`) makes of them.

:class:`AllocationLog` is a ``TorchDispatchMode`` that notes every storage an operator makes on
the traced device (in program order, when the operator returns) and when that storage is released
(its last reference gone, as CPython frees it), with marks where each phase of a step begins.
What no operator shows is added where the real allocator sees it: cuBLAS's workspace, requested
from the caching allocator at the first matrix multiply on a stream (:data:`CUBLAS_WORKSPACE`).
Fake tensors hold no memory, so nothing here costs device memory.

:func:`simulate` plays the log through :class:`~.allocator.CachingAllocator` and gives, for each
phase, allocated and reserved as ``torch.cuda.memory_stats`` would say them at its end and their
peaks inside it — and, with a limit, the request that would run out of memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from collector.estimate.allocator import AllocatorConfig, CachingAllocator, OutOfMemory
from collector.model.units import MIB

__all__ = ["CUBLAS_WORKSPACE", "AllocationLog", "Interval", "Simulated", "simulate"]

# cuBLAS's workspace, from the caching allocator, at the first matmul of a stream (torch's default
# CUBLAS_WORKSPACE_CONFIG on Hopper, ":4096:8"; seen in the H200's histories at the first matmul)
CUBLAS_WORKSPACE = 32 * MIB
_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv", "mv", "_scaled_mm")
WORKSPACE_KEY = -1


class AllocationLog:
    """Build with :meth:`mode` (a ``TorchDispatchMode``) on ``device``; ``events`` holds
    ``("a", key, bytes)``, ``("f", key, 0)``, ``("m", phase, 0)`` (a phase begins) and
    ``("e", None, 0)`` (``torch.cuda.empty_cache()``);
    ``where[key]`` is the module that was running when ``key`` was allocated (``where_now``
    says it; None: not noted); ``streams[key]`` the stream it was allocated on, where that is
    not the default one (each stream has its own pools in the allocator)."""

    def __init__(
        self,
        device: Any,
        workspace: int = CUBLAS_WORKSPACE,
        where_now: Callable[[], str] | None = None,
    ) -> None:
        self.device = device
        self.workspace = workspace
        self.where_now = where_now
        self.events: list[tuple[str, Any, int]] = []
        self.where: dict[int, str] = {}
        self.streams: dict[int, int] = {}
        self.stream = 0  # the current stream (see streams_followed())
        self.stream_now: Callable[[], int] | None = None
        self._stream_ids: dict[int, int] = {}
        self._live: set[int] = set()
        self._next = 0
        self._workspace_done = workspace == 0

    def mark(self, phase: str) -> None:
        self.events.append(("m", phase, 0))

    def _free(self, key: int) -> None:
        if key in self._live:
            self._live.discard(key)
            self.events.append(("f", key, 0))

    def key_of(self, t: Any) -> int | None:
        """The key ``t``'s storage was noted under (None: not noted)."""
        return getattr(t.untyped_storage(), "_stepmem_key", None)

    def drop(self, keys: set[int]) -> None:
        """Forget the storages ``keys`` (what the real step keeps off the device: the optimizer's
        step counters, which CUDA keeps on the host)."""
        if keys:
            self.events = [e for e in self.events if e[0] == "m" or e[1] not in keys]
            self._live -= keys

    def track(self, t: Any) -> None:
        """Note ``t``'s storage if it is new (a view shares its base's)."""
        self.track_storage(t.untyped_storage())

    def resized(self, st: Any, before: int) -> None:
        """``st`` was resized in place from ``before`` bytes (FSDP2 frees and re-gets its
        all-gathered parameters so): the old bytes freed, the new ones allocated."""
        if st.nbytes() == before:
            return
        key = getattr(st, "_stepmem_key", None)
        if key is not None:
            self._free(key)
            st._stepmem_key = None
        if key is not None or st.device in (self.device, _META):  # a fake tensor's is on meta
            self.track_storage(st)

    def track_storage(self, st: Any) -> None:
        nbytes = st.nbytes()
        if getattr(st, "_stepmem_key", None) is not None or nbytes == 0:
            return
        key = self._next
        self._next += 1
        try:
            st._stepmem_key = key
            weakref.finalize(st, self._free, key)
        except (AttributeError, TypeError):  # a storage that cannot carry the note
            return
        self._live.add(key)
        self.events.append(("a", key, int(nbytes)))
        stream = self.stream_now() if self.stream_now is not None else self.stream
        if stream:
            self.streams[key] = stream
        if self.where_now is not None:
            self.where[key] = self.where_now()

    def before(self, func: Any) -> None:
        if not self._workspace_done and func.__name__.split(".")[0] in _MATMULS:
            self._workspace_done = True
            self.events.append(("a", WORKSPACE_KEY, self.workspace))  # kept for life
            self.where[WORKSPACE_KEY] = "cuBLAS workspace"

    def mode(self) -> Any:
        import torch
        from torch._guards import active_fake_mode
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        log = self
        plain = (torch.Tensor, torch.nn.Parameter)

        class _Log(TorchDispatchMode):
            entry: Any = None

            def __enter__(self):  # the fake mode the trace runs under (None: real tensors)
                self.entry = active_fake_mode()
                return super().__enter__()

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                # a tensor subclass (DTensor) first runs as the local tensor ops that hold memory
                if any(t not in plain and not _is_fake(t) for t in types):
                    return NotImplemented
                ours = active_fake_mode() is self.entry  # not DTensor's sharding propagation
                if ours:  # (under a fake mode of its own)
                    log.before(func)
                out = func(*args, **(kwargs or {}))
                if not ours:
                    return out
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.device == log.device:
                        log.track(t)
                return out

        return _Log()

    def streams_followed(self, cuda: bool) -> Any:
        """For its duration, the stream each allocation is made on is noted: on a GPU, CUDA's
        current stream; on the CPU stand-in, the stream a ``torch.cpu.stream(s)`` block names
        (FSDP2 makes its reduce-scatter buffers in a stream of their own: CUDA keeps them in
        that stream's pools)."""
        import contextlib

        import torch

        log = self

        if cuda:  # CUDA's current stream, read at each allocation
            self.stream_now = lambda: self._stream_id(torch.cuda.current_stream())
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def on_cpu() -> Any:
            real = torch.cpu.stream

            @contextlib.contextmanager
            def stream(s: Any) -> Any:
                before = log.stream
                log.stream = log._stream_id(s)
                try:
                    with real(s):
                        yield
                finally:
                    log.stream = before

            torch.cpu.stream = stream
            try:
                yield
            finally:
                torch.cpu.stream = real

        return on_cpu()

    def _stream_id(self, s: Any) -> int:
        """0 for the default stream, else a small number per stream object."""
        import torch

        if s is None or getattr(s, "cuda_stream", 1) == 0:  # CUDA's default stream
            return 0
        if s is getattr(torch.cpu, "_default_cpu_stream", None):
            return 0
        key = getattr(s, "cuda_stream", None) or id(s)
        return self._stream_ids.setdefault(key, len(self._stream_ids) + 1)

    def resizes(self) -> Any:
        """For its duration, in-place storage resizes (``UntypedStorage.resize_``) are noted."""
        import contextlib

        import torch

        log = self

        @contextlib.contextmanager
        def patched() -> Any:
            real = torch.UntypedStorage.resize_

            def resize_(st: Any, size: int) -> Any:
                before = st.nbytes()
                out = real(st, size)
                log.resized(st, before)
                return out

            torch.UntypedStorage.resize_ = resize_
            try:
                yield
            finally:
                torch.UntypedStorage.resize_ = real

        return patched()


class _Meta:
    type = "meta"

    def __eq__(self, other: object) -> bool:
        return getattr(other, "type", None) == "meta"

    __hash__ = None  # type: ignore[assignment]


_META = _Meta()


def _is_fake(t: type) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return issubclass(t, FakeTensor)


@dataclass
class Interval:
    """One phase: allocated and reserved at its end, and their peaks inside it."""

    allocated: int = 0
    reserved: int = 0
    allocated_peak: int = 0
    reserved_peak: int = 0


@dataclass
class Simulated:
    """The log played through the allocator: each phase's interval (from its mark to the next),
    the model's final counters, and the out-of-memory that stopped it (None: none) with the
    phase and module it happened in."""

    intervals: dict[str, Interval] = field(default_factory=dict)
    retries: int = 0
    oom: OutOfMemory | None = None
    oom_phase: str = ""
    oom_module: str = ""
    segments: int = 0
    inactive_split: int = 0

    def over(self, *phases: str) -> Interval:
        """Peaks over ``phases`` (the largest), and the figures at the last one's end."""
        out = Interval()
        for p in phases:
            i = self.intervals.get(p)
            if i is not None:
                out.allocated_peak = max(out.allocated_peak, i.allocated_peak)
                out.reserved_peak = max(out.reserved_peak, i.reserved_peak)
                out.allocated, out.reserved = i.allocated, i.reserved
        return out


def simulate(
    events: list[tuple[str, Any, int]],
    config: AllocatorConfig | None = None,
    limit: int | None = None,
    fraction: bool = False,
    where: dict[int, str] | None = None,
    streams: dict[int, int] | None = None,
) -> Simulated:
    """Play ``events`` through the allocator model (``limit``: the bytes torch may reserve)."""
    model = CachingAllocator(config, limit=limit, fraction=fraction)
    handles: dict[Any, int] = {}
    out = Simulated()
    phase = ""

    def close() -> None:
        if phase:
            s = model.stats
            out.intervals[phase] = Interval(
                s.allocated, s.reserved, s.allocated_peak, s.reserved_peak
            )

    for kind, key, nbytes in events:
        if kind == "m":
            close()
            model.reset_peaks()
            phase = key
        elif kind == "a":
            try:
                handles[key] = model.malloc(nbytes, (streams or {}).get(key, 0))
            except OutOfMemory as exc:
                out.oom, out.oom_phase = exc, phase
                out.oom_module = (where or {}).get(key, "")
                break
        elif kind == "e":  # torch.cuda.empty_cache()
            model.empty_cache()
        else:
            h = handles.pop(key, None)
            if h is not None:
                model.free(h)
    close()
    out.retries = model.stats.num_alloc_retries
    out.segments = model.stats.segments
    out.inactive_split = model.stats.inactive_split
    return out

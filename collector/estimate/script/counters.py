"""``torch.cuda``'s memory queries answered from the estimate (on a GPU too: fake tensors hold no
memory, so torch's own allocator would say 0).

:class:`LiveAllocator` plays the allocation log through the caching-allocator model as the
script runs, keeping each of torch's statistics as ``CUDACachingAllocator.cpp``'s ``Stat`` does
(current, peak, allocated, freed; for all pools and per pool). :func:`counters_answered` answers
from it:

* ``memory_allocated``, ``memory_reserved``, their ``max_*``, ``reset_peak_memory_stats``,
  ``empty_cache``, ``mem_get_info`` (and ``torch.accelerator``'s same queries);
* ``memory_stats`` with every key torch gives, so torch's own ``memory_summary`` prints the
  estimate's figures;
* ``memory_snapshot``, ``memory._snapshot``/``_dump_snapshot`` from the model's segments and
  blocks, and ``memory._record_memory_history``: from then on each allocation and free the
  script makes is an entry of the snapshot's device trace (at the model's addresses), which
  ``stepmem report`` reads as it reads a history recorded on a GPU;
* ``memory._set_allocator_settings``: refused, naming ``--alloc-conf`` (the model's settings
  are fixed for the whole script);
* ``set_per_process_memory_fraction``: the share is kept (:attr:`LiveAllocator.fraction`) and
  the estimate holds the step against it, as ``--memory-fraction`` does.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable, Iterator
from typing import Any

from collector.estimate.alloc_log import AllocationLog
from collector.estimate.allocator import AllocatorConfig, CachingAllocator
from collector.estimate.allocator_config import NO_LIMIT
from collector.estimate.script.stand_ins import NotModelled
from collector.estimate.swap import swapped

__all__ = ["STATS", "LiveAllocator", "counters_answered"]

STATS = (  # torch's memory_stats() names, each with all/large_pool/small_pool and four figures
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
_POOLS = ("all", "large_pool", "small_pool")
TRACE_MAX = 100_000  # the device trace's entries kept (torch's max_entries default is larger)


class _Stat:
    """One of torch's ``Stat``s: ``current``, ``peak`` since the last reset, and the totals
    added (``allocated``) and taken away (``freed``)."""

    __slots__ = ("allocated", "current", "freed", "peak")

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def set(self, value: int) -> None:
        delta = value - self.current
        if delta > 0:
            self.allocated += delta
        else:
            self.freed -= delta
        self.current = value
        self.peak = max(self.peak, value)


class LiveAllocator:
    """The allocator model fed the log's events as they happen: torch's counters, predicted."""

    def __init__(self, log: AllocationLog, config: AllocatorConfig) -> None:
        self.log = log
        self.model = CachingAllocator(config)
        self.handles: dict[Any, int] = {}
        self.seen = 0
        self.stats = {f"{n}.{p}": _Stat() for n in STATS for p in _POOLS}
        self.stats.update(oversize_allocations=_Stat(), oversize_segments=_Stat())  # no pools
        self.fraction: float | None = None  # set_per_process_memory_fraction's share
        self.trace: list[dict[str, Any]] | None = None  # _record_memory_history: on

    def sync(self) -> Any:
        events = self.log.events
        for kind, key, nbytes in events[self.seen :]:
            reserved = self.model.stats.reserved
            if kind == "a":
                stream = self.log.streams.get(key, 0)
                self.handles[key] = h = self.model.malloc(nbytes, stream)
                self._block(self.model.live[h], +1, "alloc")
            elif kind == "f":
                h = self.handles.pop(key, None)
                if h is not None:
                    self._block(self.model.live[h], -1, "free_completed")
                    self.model.free(h)
            elif kind == "e":
                self.model.empty_cache()
            if self.model.stats.reserved != reserved:
                self._segments()
        self.seen = len(events)
        return self.model.stats

    def _block(self, b: Any, sign: int, action: str) -> None:
        """A block allocated (``sign`` +1) or freed (-1): its pool's statistics and all's."""
        pool = "small_pool" if b.small else "large_pool"
        oversize = (
            self.model.config.split_limit != NO_LIMIT and b.size > self.model.config.split_limit
        )
        for name, by in (
            ("allocation", 1),
            ("active", 1),
            ("allocated_bytes", b.size),
            ("active_bytes", b.size),
            ("requested_bytes", b.requested),
        ):
            for p in (pool, "all"):
                s = self.stats[f"{name}.{p}"]
                s.set(s.current + sign * by)
        if oversize:
            s = self.stats["oversize_allocations"]
            s.set(s.current + sign)
        if self.trace is not None and len(self.trace) < TRACE_MAX:
            self.trace.append(
                {"action": action, "addr": b.addr, "size": b.size, "stream": b.stream, "frames": []}
            )

    def _segments(self) -> None:
        """The reserved bytes and segments of each pool, after the driver gave or took some."""
        per = {"small_pool": [0, 0], "large_pool": [0, 0]}
        limit, oversize = self.model.config.split_limit, 0
        for seg, mapped in self._mapped():
            row = per["small_pool" if seg.small else "large_pool"]
            row[0] += mapped
            row[1] += 1
            oversize += 1 if limit != NO_LIMIT and seg.size > limit else 0
        for pool, (nbytes, count) in per.items():
            self.stats[f"reserved_bytes.{pool}"].set(nbytes)
            self.stats[f"segment.{pool}"].set(count)
        self.stats["oversize_segments"].set(oversize)
        for name in ("reserved_bytes", "segment"):
            self.stats[f"{name}.all"].set(
                self.stats[f"{name}.small_pool"].current + self.stats[f"{name}.large_pool"].current
            )

    def _mapped(self) -> list[tuple[Any, int]]:
        """Each segment and the bytes of it mapped (all of it but an expandable one's tail)."""
        m = self.model
        out = [(s, s.size) for s in m.segments]
        for seg in getattr(m, "_expandable", {}).values():
            pool = m.small if seg.small else m.large
            gone = sum(b.size for b in pool.unmapped if b.segment is seg)
            if seg.size - gone:
                out.append((seg, seg.size - gone))
        return out

    def _inactive(self) -> None:
        """The cached pieces of split segments (read when asked: they change at every block)."""
        m = self.model
        counts = {"small_pool": [0, 0], "large_pool": [0, 0]}
        for pool in (m.small, m.large):
            for b in pool.blocks.values():
                if b.split and not b.segment.expandable:
                    row = counts["small_pool" if b.small else "large_pool"]
                    row[0] += 1
                    row[1] += b.size
        for pool, (n, nbytes) in counts.items():
            self.stats[f"inactive_split.{pool}"].set(n)
            self.stats[f"inactive_split_bytes.{pool}"].set(nbytes)
        for name in ("inactive_split", "inactive_split_bytes"):
            self.stats[f"{name}.all"].set(
                self.stats[f"{name}.small_pool"].current + self.stats[f"{name}.large_pool"].current
            )

    def reset_peaks(self) -> None:
        self.sync()
        self.model.reset_peaks()
        for s in self.stats.values():
            s.peak = s.current

    def memory_stats(self) -> dict[str, int]:
        """``torch.cuda.memory_stats()``: every key torch gives, from the model."""
        s = self.sync()
        self._inactive()
        out: dict[str, int] = {}
        for name, stat in sorted(self.stats.items()):
            for part in ("current", "peak", "allocated", "freed"):
                out[f"{name}.{part}"] = getattr(stat, part)
        out["allocated_bytes.all.peak"] = max(out["allocated_bytes.all.peak"], s.allocated_peak)
        out["reserved_bytes.all.peak"] = max(out["reserved_bytes.all.peak"], s.reserved_peak)
        out.update(
            num_alloc_retries=s.num_alloc_retries,
            num_ooms=s.num_ooms,
            num_sync_all_streams=0,
            num_device_alloc=s.num_device_alloc,
            num_device_free=s.num_device_free,
            max_split_size=-1
            if self.model.config.split_limit == NO_LIMIT
            else self.model.config.split_limit,
        )
        return out

    def snapshot(self) -> dict[str, Any]:
        """``torch.cuda.memory._snapshot()``: the model's segments with their blocks, and the
        device trace recorded since ``_record_memory_history``."""
        self.sync()
        m = self.model
        blocks: dict[int, list[Any]] = {}
        for b in [*m.live.values(), *m.small.blocks.values(), *m.large.blocks.values()]:
            blocks.setdefault(id(b.segment), []).append(b)
        segments = []
        for seg, mapped in sorted(self._mapped(), key=lambda x: x[0].addr):
            mine = sorted(blocks.get(id(seg), []), key=lambda b: b.addr)
            live = [b for b in mine if b.allocated]
            segments.append(
                {
                    "device": 0,
                    "address": seg.addr,
                    "total_size": mapped,
                    "allocated_size": sum(b.size for b in live),
                    "active_size": sum(b.size for b in live),
                    "requested_size": sum(b.requested for b in live),
                    "stream": seg.stream,
                    "segment_type": "small" if seg.small else "large",
                    "segment_pool_id": (0, 0),
                    "is_expandable": seg.expandable,
                    "frames": [],
                    "blocks": [
                        {
                            "address": b.addr,
                            "size": b.size,
                            "requested_size": b.requested if b.allocated else 0,
                            "state": "active_allocated" if b.allocated else "inactive",
                            "frames": [],
                        }
                        for b in mine
                    ],
                }
            )
        return {
            "segments": segments,
            "device_traces": [list(self.trace or [])],
            "allocator_settings": {"expandable_segments": m.config.expandable_segments},
        }

    def record_history(self, enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
        """``_record_memory_history``: ``None`` stops it (the trace so far is dropped, as
        torch drops it)."""
        self.sync()
        self.trace = None if enabled in (None, False) else (self.trace or [])


@contextlib.contextmanager
def counters_answered(live: LiveAllocator, capacity: int, outside: int) -> Iterator[None]:
    """``torch.cuda``'s memory queries answered by ``live`` (see the module doc); ``capacity``
    and ``outside`` (this process's memory outside torch) make ``mem_get_info``'s answer."""
    import torch

    def stat(name: str) -> Callable[..., int]:
        return lambda device=None: getattr(live.sync(), name)

    def empty_cache() -> None:
        live.log.events.append(("e", None, 0))

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        used = live.sync().reserved + outside
        return max(0, capacity - used), capacity

    answers = {
        "memory_allocated": stat("allocated"),
        "max_memory_allocated": stat("allocated_peak"),
        "memory_reserved": stat("reserved"),
        "max_memory_reserved": stat("reserved_peak"),
        "memory_stats": lambda device=None: live.memory_stats(),
        "reset_peak_memory_stats": lambda device=None: live.reset_peaks(),
        "reset_max_memory_allocated": lambda device=None: live.reset_peaks(),
        "reset_max_memory_cached": lambda device=None: live.reset_peaks(),
        "empty_cache": empty_cache,
        "mem_get_info": mem_get_info,
        "get_allocator_backend": lambda: "native",
        **_fraction_and_snapshots(live),
    }

    accelerator = {  # torch.accelerator's memory queries (torch 2.8 on), the same answers
        "memory_allocated": answers["memory_allocated"],
        "max_memory_allocated": answers["max_memory_allocated"],
        "memory_reserved": answers["memory_reserved"],
        "max_memory_reserved": answers["max_memory_reserved"],
        "memory_stats": answers["memory_stats"],
        "reset_peak_memory_stats": answers["reset_peak_memory_stats"],
        "empty_cache": empty_cache,
        "get_memory_info": mem_get_info,
    }
    present = {k: v for k, v in accelerator.items() if hasattr(torch.accelerator, k)}
    with (
        swapped(torch.cuda, **answers),
        swapped(torch.cuda.memory, **answers, **_private(live)),
        swapped(torch.accelerator, **present),
    ):
        yield


def _fraction_and_snapshots(live: LiveAllocator) -> dict[str, Callable[..., Any]]:
    """``set_per_process_memory_fraction`` kept by ``live``, and its snapshot's segments."""

    def set_fraction(fraction: float, device: Any = None) -> None:
        if not (isinstance(fraction, (int, float)) and 0 <= fraction <= 1):
            raise ValueError(f"invalid fraction: {fraction}, must be between 0 and 1")
        live.fraction = float(fraction)

    return {
        "set_per_process_memory_fraction": set_fraction,
        "get_per_process_memory_fraction": lambda device=None: (
            1.0 if live.fraction is None else live.fraction
        ),
        "memory_snapshot": lambda *a, **k: live.snapshot()["segments"],
    }


def _private(live: LiveAllocator) -> dict[str, Callable[..., Any]]:
    """``torch.cuda.memory``'s history calls: the snapshot and its dump from ``live``, the
    recording switched on and off; changing the allocator's settings refused."""

    def dump(filename: str = "dump_snapshot.pickle", *args: Any, **kwargs: Any) -> None:
        with open(filename, "wb") as f:
            pickle.dump(live.snapshot(), f)

    def settings(conf: str) -> None:
        raise NotModelled(
            f"torch.cuda.memory._set_allocator_settings({str(conf)[:200]!r}): the allocator's "
            "settings are the estimate's for the whole script: give them as --alloc-conf"
        )

    return {
        "_snapshot": lambda *a, **k: live.snapshot(),
        "_dump_snapshot": dump,
        "_record_memory_history": live.record_history,
        "_set_allocator_settings": settings,
    }

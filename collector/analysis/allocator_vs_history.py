"""The allocator model (:mod:`collector.estimate.allocator`) held against the real allocator: a
memory history recorded on a GPU (``torch.cuda.memory._record_memory_history``, the run store's
``history/``) replayed request by request through the model, and what the model did compared with
what PyTorch did — each new segment (its size, and whether the model asked for one at the same
request), each block (the model's choice of address against the real one), and torch's reserved
bytes at every step end of the recording.

The recording starts mid-run (the probe starts it at the first step's begin, after the model and
its optimizer exist), so the allocator's state at that moment is rebuilt first, from the snapshot
taken at the end and the trace between: the segments that existed then (those at the end that the
trace did not make, and those it freed), and the blocks live then (live at the end and never
allocated in the trace, or freed in it before being allocated). Where a block live at the start
was freed during the trace, its size is its request rounded as the allocator rounds it, the rest
of its segment up to the next live block when that rest is too small to have been split off.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collector.analysis.history import HistoryError, load_snapshot
from collector.estimate.allocator import (
    SMALL_SIZE,
    AllocatorConfig,
    CachingAllocator,
    OutOfMemory,
    round_size,
)

__all__ = ["Replayed", "StepEnd", "replay_history"]

_GOT = ("segment_alloc", "segment_map")  # what a request gets from the driver


@dataclass
class StepEnd:
    """Torch's reserved bytes at one step's end mark: the real allocator's (from the trace's
    segment events), the model's, and the probe's own reading when one is given."""

    step: int
    real: int
    model: int
    probe: int | None = None
    allocated_peak: int = 0  # the model's (the requests' blocks): torch's allocated peak

    @property
    def cache_share(self) -> float:
        """The share of reserved that no live block held at the step's allocated peak."""
        return 1 - self.allocated_peak / self.real if self.real else 0.0

    @property
    def error(self) -> float:
        return (self.model - self.real) / self.real if self.real else 0.0


@dataclass
class Replayed:
    """One history replayed: the config the run used, each step end, and how the model's
    segments and blocks matched the real ones."""

    source: str
    config: AllocatorConfig
    steps: list[StepEnd] = field(default_factory=list)
    requests: int = 0
    frees: int = 0
    # what each side got from the driver, in order: a segment (cudaMalloc) or mapped pages
    # (expandable segments), by size
    segments_real: list[int] = field(default_factory=list)
    segments_model: list[int] = field(default_factory=list)
    segments_matched: int = 0  # got by the model at the same request, of the same size
    addresses_matched: int = 0  # the model chose the block the real allocator chose
    unknown_frees: int = 0
    ooms: int = 0

    @property
    def worst_error(self) -> float:
        return max((abs(s.error) for s in self.steps), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "config": self.config.describe(),
            "requests": self.requests,
            "frees": self.frees,
            "segments_real": len(self.segments_real),
            "segments_model": len(self.segments_model),
            "segments_matched": self.segments_matched,
            "segment_sizes_equal": self.segments_real == self.segments_model,
            "addresses_matched": self.addresses_matched,
            "unknown_frees": self.unknown_frees,
            "worst_step_end_error": self.worst_error,
            "steps": [
                {
                    "step": s.step,
                    "real": s.real,
                    "model": s.model,
                    "probe": s.probe,
                    "allocated_peak": s.allocated_peak,
                }
                for s in self.steps
            ],
        }


def _start_state(snap: dict[str, Any], trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The segments at the trace's first event, each with its live blocks then."""
    made = {e["addr"] for e in trace if e["action"] == "segment_alloc"}
    segs: dict[int, dict[str, Any]] = {}
    for s in snap["segments"]:
        if s["address"] in made:
            continue
        live = [
            (b["address"], b["size"], b.get("requested_size") or b["size"])
            for b in s["blocks"]
            if b["state"].startswith("active")
        ]
        size = s["total_size"]
        if s.get("is_expandable"):  # what was mapped then: now, less what the trace mapped
            lo, hi = s["address"], s["address"] + s["total_size"]
            for e in trace:
                if e["action"] in ("segment_map", "segment_unmap") and lo <= e["addr"] < hi:
                    size += -e["size"] if e["action"] == "segment_map" else e["size"]
        segs[s["address"]] = {"addr": s["address"], "size": size, "live": live}
        segs[s["address"]]["stream"] = s.get("stream", 0)
        segs[s["address"]]["expandable"] = bool(s.get("is_expandable"))
        segs[s["address"]]["small"] = s.get("segment_type") == "small"
    for e in trace:
        if e["action"] == "segment_free" and e["addr"] not in made:
            segs.setdefault(e["addr"], {"addr": e["addr"], "size": e["size"], "live": []})
            segs[e["addr"]].setdefault("stream", e.get("stream", 0))
    first: dict[int, str] = {}
    sizes: dict[int, int] = {}
    for e in trace:
        if e["action"] in ("alloc", "free_completed") and e["addr"] not in first:
            first[e["addr"]] = e["action"]
            sizes[e["addr"]] = e["size"]
    # a block live at the end whose address the trace allocated came from the trace, even when
    # the trace first freed what lived there before
    allocated_in_trace = {e["addr"] for e in trace if e["action"] == "alloc"}
    for seg in segs.values():
        seg["live"] = [b for b in seg["live"] if b[0] not in allocated_in_trace]
        known = {b[0] for b in seg["live"]}
        lo, hi = seg["addr"], seg["addr"] + seg["size"]
        freed = sorted(a for a, kind in first.items() if kind == "free_completed" and lo <= a < hi)
        for a in freed:
            if a in known:
                continue
            seg["live"].append((a, _start_block_size(a, sizes[a], seg, freed), sizes[a]))
        seg["live"] = [b for b in seg["live"] if b[0] < seg["addr"] + seg["size"]]
        seg["live"].sort()
    return list(segs.values())


def _start_block_size(addr: int, requested: int, seg: dict[str, Any], freed: list[int]) -> int:
    """A block live at the start and freed in the trace: its request rounded; in the large pool
    the rest of the gap before the next block too when it is 1 MiB or less (not split off)."""
    size = round_size(requested)
    if seg.get("expandable"):  # an expandable segment's blocks are split at 512 bytes
        return size
    nxt = min(
        [a for a in freed if a > addr] + [b[0] for b in seg["live"] if b[0] > addr],
        default=seg["addr"] + seg["size"],
    )
    gap = nxt - addr
    if size > SMALL_SIZE and 0 <= gap - size <= SMALL_SIZE:
        return gap
    return min(size, gap) if gap > 0 else size


def _marks(folder: Path) -> list[tuple[int, int]]:
    """(step, wall µs) of each step-end mark the probe wrote beside the history."""
    path = folder / "marks.json"
    if not path.is_file():
        return []
    try:
        marks = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise HistoryError(f"{path}: not readable ({exc})") from None
    return [
        (int(m["step"]), int(m["wall_us"]))
        for m in marks
        if isinstance(m, dict) and m.get("kind") == "end"
    ]


def replay_history(
    path: str | Path, probe_reserved: dict[int, int] | None = None, device: int = 0
) -> Replayed:
    """Replay the history at ``path`` (a ``history-steps-A-B.pickle``; ``marks.json`` beside it
    gives the step ends) through the model with the settings the run used. ``probe_reserved``:
    torch reserved at each step's end as the probe read it (the run store's), to show beside."""
    path = Path(path)
    snap = load_snapshot(path)
    traces = snap.get("device_traces") or [[]]
    trace = traces[device] if device < len(traces) else []
    config = AllocatorConfig.from_snapshot(snap.get("allocator_settings") or {})
    out = Replayed(str(path), config)
    model = CachingAllocator(config, keep_events=True)
    handles: dict[int, int] = {}
    real_reserved = 0
    for seg in _start_state(snap, trace):
        if seg.get("expandable"):
            got = model.adopt_expandable(
                seg["addr"], seg["size"], seg["stream"], seg["small"], seg["live"]
            )
        else:
            got = model.adopt_segment(seg["addr"], seg["size"], seg["stream"], seg["live"])
        handles.update(got)
        real_reserved += seg["size"]
    marks = _marks(path.parent)
    mark_i = 0
    pending: list[tuple[int, int]] = []  # what the real allocator just got from the driver
    for e in trace:
        while mark_i < len(marks) and marks[mark_i][1] < e["time_us"]:
            out.steps.append(_step_end(marks[mark_i][0], real_reserved, model, probe_reserved))
            mark_i += 1
        kind = e["action"]
        if kind in ("segment_alloc", "segment_map"):  # a new segment, or pages mapped
            pending.append((e["addr"], e["size"]))
            out.segments_real.append(e["size"])
            real_reserved += e["size"]
        elif kind == "segment_free":
            real_reserved -= e["size"]
            model.release_segment(e["addr"])
        elif kind == "segment_unmap":
            real_reserved -= e["size"]
        elif kind == "alloc":
            _replay_alloc(e, model, handles, out, pending)
            pending = []
        elif kind == "free_completed":
            out.frees += 1
            h = handles.pop(e["addr"], None)
            if h is None:
                out.unknown_frees += 1
            else:
                model.free(h)
    for step, _ in marks[mark_i:]:
        out.steps.append(_step_end(step, real_reserved, model, probe_reserved))
    return out


def _replay_alloc(
    e: dict[str, Any],
    model: CachingAllocator,
    handles: dict[int, int],
    out: Replayed,
    pending: list[tuple[int, int]],
) -> None:
    out.requests += 1
    before = len(model.events)
    addr = pending[0][0] if len(pending) == 1 and not model.config.expandable_segments else None
    try:
        h = model.malloc(e["size"], e.get("stream", 0), segment_addr=addr)
    except OutOfMemory:  # the model has no limit here; kept for completeness
        out.ooms += 1
        return
    made = [(a, size) for kind, a, size in model.events[before:] if kind in _GOT]
    made = [m for m in made if m[1] > 0]
    out.segments_model.extend(size for _, size in made)
    if [size for _, size in made] == [size for _, size in pending]:  # the same, at this request
        out.segments_matched += len(made)
    handles[e["addr"]] = h
    if model.address(h) == e["addr"]:
        out.addresses_matched += 1


def _step_end(
    step: int, real: int, model: CachingAllocator, probe: dict[int, int] | None
) -> StepEnd:
    out = StepEnd(step, real, model.stats.reserved, (probe or {}).get(step))
    out.allocated_peak = model.stats.allocated_peak
    model.reset_peaks()
    return out


def summary(results: list[Replayed]) -> dict[str, Any]:
    """Every replay's figures, and the worst step-end error over all of them."""
    by: dict[str, Any] = defaultdict(list)
    for r in results:
        by["histories"].append(r.to_dict())
    by["worst_step_end_error"] = max((r.worst_error for r in results), default=0.0)
    return dict(by)

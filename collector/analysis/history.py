"""Which line allocated it: reading the allocation history the probe saves
(:class:`collector.probe.recording.AllocationHistory`).

A snapshot from ``torch.cuda.memory._snapshot()`` holds, per device, the trace of allocator
actions (``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``…) with their size,
address, Python stack (``frames``) and time (``time_us``, wall clock). ``marks.json`` holds the
wall-clock time of each step mark. Replaying the trace against the marks gives, for each recorded
step: the allocations live at its within-step peak of allocated bytes and at its end, grouped by
the line that made them (its *site*: the innermost frame outside PyTorch itself), and the memory
allocated in step N that is still live at the end of step N+1 (state created in step N).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import lzma
import pickle
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collector.model.errors import InputError
from collector.model.kinds import Phase
from collector.model.untrusted import inert, read_json

__all__ = ["HistoryError", "Site", "StepSites", "load", "site_of", "step_sites"]


class HistoryError(InputError):
    """A history folder that cannot be read as one (corrupt, or holding more than data)."""


class _DataOnly(pickle.Unpickler):
    """Unpickles plain data only — dicts, lists, tuples, strings, numbers, None — which is all
    a PyTorch memory snapshot holds. Any object that would need a class or a function (the
    way a planted pickle runs code) is refused: a run store is data and is never executed."""

    def find_class(self, module: str, name: str) -> Any:
        raise HistoryError(
            f"it asks to load {module}.{name}: a memory snapshot holds plain data only, so it is "
            "refused unread (a pickle can run code)"
        )


def load_snapshot(path: Path) -> dict[str, Any]:
    """A memory snapshot pickle (or one compressed with xz, ``.pickle.xz``, as the committed
    histories are), read with :class:`_DataOnly`."""
    try:
        with lzma.open(path, "rb") if path.suffix == ".xz" else open(path, "rb") as f:
            snap = _DataOnly(f).load()
    except HistoryError as exc:
        raise HistoryError(f"{path.name}: {exc}") from None
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        IndexError,
        MemoryError,
        RecursionError,
        OverflowError,
        AttributeError,
        KeyError,
        lzma.LZMAError,
    ) as exc:
        raise HistoryError(
            f"{path.name} is not a readable snapshot ({type(exc).__name__})"
        ) from None
    if not isinstance(snap, dict):
        raise HistoryError(f"{path.name} is not a memory snapshot (a {type(snap).__name__})")
    return snap


NO_FRAMES = "(no Python frame: autograd's engine or other C++ code)"
# Bounds on what a history may ask of the reader (a data-only pickle can share one stack among
# millions of entries): PyTorch's histories of a few steps hold tens of thousands of events,
# stacks of a few dozen frames, a handful of marks a step.
MAX_ENTRIES = 2_000_000
MAX_FRAMES = 512
MAX_MARKS = 4096
MAX_MARKS_BYTES = 4 << 20
MAX_SITE_READS = 5_000_000  # site sums read at marks, over a whole trace
# modules that are plumbing, not the line that asked for memory (PyTorch's own, the stdlib's)
_PLUMBING = ("torch/", "contextlib.py", "functools.py", "threading.py")
_LIBRARY_ROOTS = ("site-packages/", "dist-packages/")


def _short(path: str) -> str:
    """A file's path from its package down: ``transformers/models/llama/modeling_llama.py``
    (``site-packages``/``dist-packages`` cut), else its last three parts."""
    for root in _LIBRARY_ROOTS:
        if root in path:
            return path.rsplit(root, 1)[1]
    return "/".join(path.split("/")[-3:])


def _is_stdlib(path: str) -> bool:
    return "/lib/python3" in path and not any(root in path for root in _LIBRARY_ROOTS)


def _is_users(path: str) -> bool:
    """A frame of the user's own code: not an installed package, not the standard library,
    not PyTorch, not Python's own (``<frozen runpy>``), not stepmem's runner."""
    if not path or path.startswith("<") or _is_stdlib(path):
        return False
    if any(root in path for root in _LIBRARY_ROOTS):
        return False
    if _short(path).startswith(_PLUMBING):
        return False
    return not any(path.endswith(own) for own in _stepmem_files())


@functools.cache
def _stepmem_files() -> tuple[str, ...]:
    """stepmem's own modules as paths end (``collector/run/runners.py``): its runner and probe
    frames are not the user's line, wherever the history was recorded."""
    root = Path(__file__).resolve().parent.parent  # the collector package
    return tuple(p.relative_to(root.parent).as_posix() for p in root.rglob("*.py"))


def site_of(frames: Iterable[dict[str, Any]]) -> str:
    """Where an allocation came from: the innermost frame outside PyTorch's own code (a
    library's line, ``file:line (function)``), preceded by the innermost frame of the user's
    own code that led to it (``workloads/cases.py:69 (run) → transformers/…:480 (forward)``)
    when that is another frame; a frame of PyTorch's when there is no other."""
    frames = list(itertools.islice(frames or [], MAX_FRAMES))
    lib = None
    for f in frames:
        name = str(f.get("filename", ""))
        if name and not name.startswith("<") and not _short(name).startswith(_PLUMBING):
            lib = f
            break
    if lib is None:
        return _fmt(frames[0]) if frames else NO_FRAMES
    user = next((f for f in frames if _is_users(str(f.get("filename", "")))), None)
    if user is None or user is lib:
        return _fmt(lib)
    return f"{_fmt(user)} → {_fmt(lib)}"


def _fmt(f: dict[str, Any]) -> str:
    where = f"{_short(str(f.get('filename', '?')))}:{f.get('line', '?')} ({f.get('name', '?')})"
    return inert(where)[:300]  # a file's own words, printed


@dataclass
class Site:
    site: str
    bytes: int
    count: int


@dataclass
class StepSites:
    """One recorded step of one device."""

    step: int
    peak_bytes: int = 0  # allocated bytes at the step's peak (from the trace)
    peak_phase: str = ""
    at_peak: list[Site] = field(default_factory=list)
    at_end: list[Site] = field(default_factory=list)
    kept_to_next: list[Site] = field(default_factory=list)  # made in this step, live after next


def load(folder: Path) -> list[tuple[int, int, dict[str, Any], list[dict[str, Any]]]]:
    """Every ``history-steps-A-B.pickle`` of ``folder`` in step order, as (A, B, snapshot, the
    marks of steps A–B from ``marks.json``)."""
    found = []
    for p in folder.glob("history-steps-*.pickle*"):
        if p.suffix not in (".pickle", ".xz") or p.name.endswith(".tmp"):
            continue
        stem = p.name.removesuffix(".xz").removesuffix(".pickle")
        try:
            a, b = (int(x) for x in stem.removeprefix("history-steps-").split("-", 1))
        except ValueError:
            continue
        found.append((a, b, p))
    if not found:
        raise FileNotFoundError(f"no history snapshot in {folder}")
    try:
        marks = read_json(folder / "marks.json", MAX_MARKS_BYTES, "marks.json")
    except OSError as exc:
        raise HistoryError(f"marks.json is unreadable ({type(exc).__name__})") from None
    except ValueError as exc:
        raise HistoryError(str(exc)) from None
    if isinstance(marks, list) and len(marks) > MAX_MARKS:
        raise HistoryError(f"marks.json lists {len(marks):,} marks; at most {MAX_MARKS:,} read")
    if not isinstance(marks, list) or not all(
        isinstance(m, dict)
        and isinstance(m.get("step"), int)
        and isinstance(m.get("wall_us"), int)
        and isinstance(m.get("kind"), str)
        for m in marks
    ):
        raise HistoryError("marks.json does not list step marks")
    out = []
    for a, b, p in sorted(found):
        out.append((a, b, load_snapshot(p), [m for m in marks if a <= m["step"] <= b]))
    return out


def _memo_sites() -> Any:
    """:func:`site_of`, once per stack: a stack shared by many entries (pickle's memo keeps one
    list for all of them) is walked once."""
    sites: dict[int, str] = {}

    def site(frames: Any) -> str:
        key = id(frames)
        if key not in sites:
            sites[key] = site_of(frames)
        return sites[key]

    return site


def _top(items: dict[str, list[int]], n: int) -> list[Site]:
    rows = [Site(site, b, c) for site, (b, c) in items.items()]
    return sorted(rows, key=lambda s: -s.bytes)[:n]


class _Live:
    """The blocks live now, summed by site as they come and go (and by the step that allocated
    them): what a step's summary needs at a mark is read off these sums, never a copy of every
    live block (a trace of 100,000 live blocks and 2,000 steps would otherwise be 2,000 copies)."""

    def __init__(self) -> None:
        self.blocks: dict[Any, tuple[int, str, int | None]] = {}  # addr -> size, site, step
        self.by_site: dict[str, list[int]] = {}
        self.by_step: dict[int | None, dict[str, list[int]]] = defaultdict(dict)
        self.total = 0
        self.work = 0  # sites read at marks, bounded by MAX_SITE_READS

    def alloc(self, addr: Any, size: int, site: str, step: int | None) -> None:
        self.free(addr)
        self.blocks[addr] = (size, site, step)
        self.total += size
        for acc in (self.by_site, self.by_step[step]):
            row = acc.setdefault(site, [0, 0])
            row[0] += size
            row[1] += 1

    def free(self, addr: Any) -> None:
        block = self.blocks.pop(addr, None)
        if block is None:
            return
        size, site, step = block
        self.total -= size
        for acc in (self.by_site, self.by_step[step]):
            row = acc[site]
            row[0] -= size
            row[1] -= 1
            if row[1] == 0:
                del acc[site]

    def top(self, top: int, step: int | None = None, by_step: bool = False) -> list[Site]:
        acc = self.by_step.get(step, {}) if by_step else self.by_site
        self.work += len(acc)
        if self.work > MAX_SITE_READS:
            raise HistoryError(
                f"its trace asks for more than {MAX_SITE_READS:,} site sums across its marks "
                "(live blocks of many sites at many marks); not read"
            )
        return _top(acc, top)


def step_sites(
    snap: dict[str, Any], marks: list[dict[str, Any]], device: int = 0, top: int = 8
) -> list[StepSites]:
    """Per recorded step: the top ``top`` sites by bytes live at its peak and at its end, and
    those of memory it allocated that is still live at the end of the next step."""
    traces = snap.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    if len(trace) > MAX_ENTRIES:
        raise HistoryError(f"its trace holds {len(trace):,} events; at most {MAX_ENTRIES:,} read")
    site = _memo_sites()
    if marks:  # what an earlier recording left in PyTorch's trace is not these steps'
        start = min(m["wall_us"] for m in marks)
        trace = [e for e in trace if int(e.get("time_us", 0)) >= start]
    ends = {m["step"]: m["wall_us"] for m in marks if m["kind"] == "end"}
    begins = {m["step"]: m["wall_us"] for m in marks if m["kind"] == "begin"}
    bounds = sorted(
        (t, m["step"], m["kind"], m.get("phase", "")) for m in marks for t in [m["wall_us"]]
    )
    times = [b[0] for b in bounds]

    def where(t: int) -> tuple[int | None, str]:
        """(step, phase) of time ``t``: the last mark at or before it (None: before the first
        or between an end and the next begin)."""
        i = bisect.bisect_right(times, t) - 1
        if i < 0 or bounds[i][2] == "end":
            return None, ""
        return bounds[i][1], bounds[i][3] or Phase.FORWARD_BACKWARD

    out = {s: StepSites(s) for s in sorted(ends) if s in begins}
    peak_t: dict[int, int] = {}
    end_pending = sorted((t, s) for s, t in ends.items() if s in out)
    live = _Live()

    def flush_ends(upto: int) -> None:
        while end_pending and end_pending[0][0] <= upto:
            _, s = end_pending.pop(0)
            out[s].at_end = live.top(top)
            if s - 1 in out:  # made in the step before, live at this one's end
                out[s - 1].kept_to_next = live.top(top, s - 1, by_step=True)

    for e in trace:
        t = int(e.get("time_us", 0))
        flush_ends(t)
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            step, phase = where(t)
            live.alloc(addr, int(e.get("size", 0)), site(e.get("frames")), step)
            if step in out and live.total > out[step].peak_bytes:
                out[step].peak_bytes, out[step].peak_phase, peak_t[step] = live.total, phase, t
        elif action == "free_completed":
            live.free(addr)
    flush_ends(1 << 62)

    # the live set at each step's peak: replay again up to the peak's time
    again = _Live()
    again.work = live.work
    want = sorted((t, s) for s, t in peak_t.items())
    k = 0
    for e in trace:
        t = int(e.get("time_us", 0))
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            again.alloc(addr, int(e.get("size", 0)), site(e.get("frames")), None)
        elif action == "free_completed":
            again.free(addr)
        while k < len(want) and t >= want[k][0]:
            out[want[k][1]].at_peak = again.top(top)
            k += 1
    return list(out.values())


def summary(folder: Path, top: int = 8) -> dict[str, Any]:
    """Everything the report shows of a history folder, as JSON-ready data: each recorded step
    (one of the first steps, or with ``after_jump`` > 0 the step after a jump of torch reserved
    of that many bytes). :class:`HistoryError` for a folder that is not what the probe writes
    (``FileNotFoundError`` for one without a snapshot)."""
    try:
        return _summary(folder, top)
    except (TypeError, KeyError, ValueError, AttributeError, IndexError) as exc:
        if isinstance(exc, HistoryError):
            raise
        raise HistoryError(
            f"its snapshot is not shaped as PyTorch writes one ({exc!r:.80})"
        ) from None


def _summary(folder: Path, top: int) -> dict[str, Any]:
    entries, steps = 0, []
    t_all: list[int] = []
    marks_all: list[dict[str, Any]] = []
    for _, _, snap, marks in load(folder):
        traces = snap.get("device_traces") or [[]]
        start = min((m["wall_us"] for m in marks), default=0)
        t_us = [t for e in traces[0] if (t := int(e.get("time_us", 0))) >= start]
        entries += len(t_us)
        t_all += [min(t_us), max(t_us)] if t_us else []
        marks_all += marks
        jumps = {m["step"]: m["after_jump"] for m in marks if m.get("after_jump")}
        for r in step_sites(snap, marks, top=top):
            steps.append(
                {
                    "step": r.step,
                    # recorded as one of the first steps, or as the step after a jump of torch
                    # reserved (its size, bytes, at the step before's end)
                    "after_jump": jumps.get(r.step, 0),
                    "peak_bytes": r.peak_bytes,
                    "peak_phase": r.peak_phase,
                    "at_peak": [s.__dict__ for s in r.at_peak],
                    "at_end": [s.__dict__ for s in r.at_end],
                    "kept_to_next": [s.__dict__ for s in r.kept_to_next],
                }
            )
    return {
        "trace_entries": entries,
        "trace_time_us": [min(t_all), max(t_all)] if t_all else None,
        "marks_time_us": [marks_all[0]["wall_us"], marks_all[-1]["wall_us"]] if marks_all else None,
        "steps": steps,
    }


if __name__ == "__main__":  # python -m collector.analysis.history FOLDER: the summary as JSON
    import sys

    print(json.dumps(summary(Path(sys.argv[1])), indent=1))

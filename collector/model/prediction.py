"""An estimate as it crosses boundaries: what ``stepmem estimate`` writes (``--out``), what a
probe given ``STEPMEM_ESTIMATE`` reads its predicted peak from, and what ``report --estimate``
holds a run against. Made by :mod:`collector.estimate`; a file somebody else wrote is data,
checked here and never executed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from collector.model.errors import EstimateError
from collector.model.kinds import Phase
from collector.model.untrusted import inert, read_json

__all__ = [
    "FORMAT",
    "CardInfo",
    "Estimate",
    "Fit",
    "ModulePeak",
    "SearchResult",
    "StepFigures",
    "Traced",
    "load_estimate",
]

FORMAT = 1


@dataclass
class ModulePeak:
    """A module's peak in one pass: device bytes by :class:`collector.model.kinds.MemoryKind`
    at that moment."""

    module: str
    phase: str  # Phase.FORWARD | Phase.BACKWARD
    total: int
    parts: dict[str, int]


@dataclass(frozen=True)
class StepFigures:
    """One traced step as torch's counters would read it (the allocator model): allocated and
    reserved peaks, what they are at its end, and the phase of the reserved peak (``"backward
    2"``: the phase and its micro-batch)."""

    step: int
    allocated_peak: int
    reserved_peak: int
    allocated_end: int
    reserved_end: int
    reserved_peak_phase: str = ""

    @classmethod
    def from_untrusted(cls, d: Any) -> StepFigures:
        d = _object(d, "a step's figures")
        step = _bytes(d.get("step"), "a step's number")
        return cls(
            step,
            *(
                _bytes(d.get(k), f"step {step}'s {k}")
                for k in ("allocated_peak", "reserved_peak", "allocated_end", "reserved_end")
            ),
            _text(d.get("reserved_peak_phase", ""), 64),
        )


@dataclass(frozen=True)
class CardInfo:
    """The GPU an estimate was held against, as the file keeps it
    (:class:`collector.estimate.gpus.Card` as data)."""

    name: str
    capacity: int
    outside_torch: int = 0
    outside_source: str = ""
    assumed: bool = False
    driver_reserved: int = 0

    @classmethod
    def from_untrusted(cls, d: Any) -> CardInfo:
        d = _object(d, "card")
        return cls(
            name=_text(d.get("name", ""), 128),
            capacity=_bytes(d.get("capacity"), "the card's capacity"),
            outside_torch=_bytes(d.get("outside_torch", 0), "the card's outside_torch"),
            outside_source=_text(d.get("outside_source", ""), 256),
            assumed=bool(d.get("assumed", False)),
            driver_reserved=_bytes(d.get("driver_reserved", 0), "the card's driver_reserved"),
        )


@dataclass(frozen=True)
class Fit:
    """Whether the step fits the card (:func:`collector.estimate.fit.hold`): what torch may
    reserve there (``limit``), less the margin (``usable``), what the step needs (its reserved
    peak), the headroom, and the allocator's retries (a step that fits only by freeing its
    cache). When it does not fit: where it first runs out (``phase``, ``module``), the request
    refused and how many bytes are missing (``short``)."""

    fits: bool
    limit: int = 0
    usable: int = 0
    margin: float = 0.0
    fraction: float | None = None
    need: int = 0
    headroom: int = 0
    retries: int = 0
    phase: str | None = None
    module: str | None = None
    request: int | None = None
    short: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for k in ("phase", "module", "request", "short"):  # only where it runs out
            if out[k] is None:
                del out[k]
        return out

    @classmethod
    def from_untrusted(cls, d: Any) -> Fit:
        d = _object(d, "fit")
        kw: dict[str, Any] = {"fits": bool(d.get("fits"))}
        for k in ("limit", "usable", "need", "headroom", "retries", "request", "short"):
            if d.get(k) is not None:
                v = d[k]
                if not isinstance(v, int) or isinstance(v, bool) or abs(v) >= 1 << 50:
                    raise EstimateError(f"estimate: fit's {k} must be a byte count")
                kw[k] = v
        for k in ("phase", "module"):
            if k in d:
                kw[k] = _text(d[k], 256)
        kw["margin"] = _share(d.get("margin", 0.0), "fit's margin")
        if d.get("fraction") is not None:
            kw["fraction"] = _share(d["fraction"], "fit's fraction")
        return cls(**kw)


@dataclass(frozen=True)
class Traced:
    """One size a search traced: its value, what its step needs, whether it fit."""

    value: int
    need: int
    fits: bool


@dataclass(frozen=True)
class SearchResult:
    """``--max-batch`` / ``--max-seq-len``: the axis searched, its grid step, the largest value
    that fits (None: not even the smallest), whether the search closed on it (the next size up
    traced and refused), the usable bytes and margin it was held to, and every size traced."""

    axis: str
    step: int
    largest: int | None
    converged: bool
    usable: int
    margin: float
    traced: tuple[Traced, ...] = ()

    @property
    def first(self) -> Traced:
        return self.traced[0]

    @classmethod
    def from_untrusted(cls, d: Any) -> SearchResult:
        d = _object(d, "largest")
        if d.get("axis") not in ("batch", "seq_len"):
            raise EstimateError("estimate: largest must name its axis (batch or seq_len)")
        found = d.get("largest")
        return cls(
            axis=d["axis"],
            step=_bytes(d.get("step"), "largest's step"),
            largest=None if found is None else _bytes(found, "largest's value"),
            converged=bool(d.get("converged", False)),
            usable=_bytes(d.get("usable"), "largest's usable bytes"),
            margin=_share(d.get("margin", 0.0), "largest's margin"),
            traced=tuple(
                Traced(
                    _bytes(t.get("value"), "a traced value"),
                    _bytes(t.get("need"), "a traced need"),
                    bool(t.get("fits")),
                )
                for t in list(d.get("traced") or [])[:64]
                if isinstance(t, dict)
            ),
        )


@dataclass
class Estimate:
    """A prediction. Byte figures are per device (the model's one device), by
    :class:`collector.model.kinds.MemoryKind`; ``steady`` is step 2's peak by kind, ``first``
    step 1's; ``at_end`` what stays resident after a step (parameters, buffers, optimizer state:
    the ledger's figures at a step end)."""

    spec: dict[str, Any]
    device: str
    stand_in: bool  # fake tensors on the CPU standing in for CUDA
    parameters_count: int
    steady: dict[str, int]
    first: dict[str, int]
    at_end: dict[str, int]
    optimizer_state_managed: int = 0
    peak_module: str = ""
    peak_phase: str = ""
    modules: list[ModulePeak] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stopped_at: str = ""  # the module that could not be traced ("" when every one was)
    seconds: float = 0.0
    torch: str = ""
    format: int = FORMAT
    # bytes torch allocated on the GPU while estimating (max_memory_allocated; None: no GPU)
    device_allocated: int | None = None
    # FSDP2: the most all-gathered (unsharded) parameter bytes at any module boundary of step 2
    unsharded_peak: int = 0
    # what the GPU holds (the allocator model; empty in estimates made before it): the settings
    # assumed, and per traced step torch's allocated and reserved peaks and ends
    allocator: str = ""
    steps: list[StepFigures] = field(default_factory=list)
    # this process's memory outside torch (CUDA context, kernels loaded on first use), and whence
    outside_torch: int = 0
    outside_source: str = ""
    # the GPU held against (gpus.Card as data) and what fits on it (fit.hold)
    card: CardInfo | None = None
    fit: Fit | None = None
    # --max-batch / --max-seq-len: the search (estimate.largest) that found this estimate's size
    largest: SearchResult | None = None
    # how many of the parameters train (LoRA: the adapters); None in estimates made before it
    trainable_count: int | None = None
    # why these figures are not trustworthy: a value read from a fake tensor (a placeholder)
    # decided what is allocated ("": none did, or the estimate was made before this was checked)
    undecided: str = ""
    # one optimizer step's FLOPs (every micro-batch, a recomputed forward included) as torch's
    # FLOP formulas count them on the traced shapes; None: not counted (a stopped trace, a
    # script, an estimate made before it)
    step_flops: int | None = None

    @property
    def script(self) -> bool:
        """An estimate of a user's script (``stepmem estimate --script``)."""
        return self.spec.get("workload") == "script"

    @property
    def subject(self) -> str:
        """What was estimated, in words: a script, a built-in size or a config's model."""
        s = self.spec
        if self.script:
            return f"script {s.get('script')}"
        if s.get("config"):
            return f"a {inert(str((s.get('config') or {}).get('model_type', '?')))[:64]} config"
        return str(s.get("size") or "a config")

    @property
    def reserved_peak(self) -> int | None:
        """Torch's reserved peak over the traced steps (None: not modelled)."""
        return max((s.reserved_peak for s in self.steps), default=None)

    @property
    def allocated_peak(self) -> int | None:
        """Torch's allocated peak over the traced steps as the allocator counts it (blocks
        rounded to 512 bytes, cuBLAS's workspace included); None: not modelled."""
        return max((s.allocated_peak for s in self.steps), default=None)

    @property
    def nvml_peak(self) -> int | None:
        """What NVML would show at the peak: reserved, memory outside torch, paged state."""
        r = self.reserved_peak
        return None if r is None else r + self.outside_torch + self.optimizer_state_managed

    @property
    def peak(self) -> int:
        return sum(self.steady.values())

    @property
    def first_peak(self) -> int:
        return sum(self.first.values())

    @property
    def largest_peak(self) -> int:
        """The largest allocated peak of the steps traced (what the headline names)."""
        return max(self.peak, self.first_peak)

    @property
    def largest_step(self) -> int:
        return 1 if self.first_peak > self.peak else 2

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fit"] = self.fit.to_dict() if self.fit is not None else None
        return out

    @classmethod
    def from_dict(cls, d: Any) -> Estimate:
        """An estimate from its JSON; anything malformed is an :class:`EstimateError`."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise EstimateError("not a stepmem estimate (format 1)")
        try:
            return cls(
                spec=_tree(dict(d["spec"])),
                device=_text(d["device"], 64),
                stand_in=bool(d["stand_in"]),
                parameters_count=int(d["parameters_count"]),
                steady=_parts(d["steady"], "steady"),
                first=_parts(d["first"], "first"),
                at_end=_parts(d["at_end"], "at_end"),
                optimizer_state_managed=int(d.get("optimizer_state_managed", 0)),
                peak_module=_text(d.get("peak_module", ""), 256),
                peak_phase=Phase.read(_text(d.get("peak_phase", ""), 16)),
                modules=[_module(m) for m in d.get("modules", [])[:10_000]],
                notes=[_text(x, 500) for x in d.get("notes", [])][:50],
                stopped_at=_text(d.get("stopped_at", ""), 256),
                seconds=float(d.get("seconds", 0.0)),
                torch=_text(d.get("torch", ""), 64),
                device_allocated=(
                    int(d["device_allocated"]) if d.get("device_allocated") is not None else None
                ),
                unsharded_peak=int(d.get("unsharded_peak", 0)),
                allocator=_text(d.get("allocator", ""), 256),
                steps=[StepFigures.from_untrusted(x) for x in list(d.get("steps") or [])[:16]],
                outside_torch=_bytes(d.get("outside_torch", 0), "outside_torch"),
                outside_source=_text(d.get("outside_source", ""), 256),
                card=None if d.get("card") is None else CardInfo.from_untrusted(d["card"]),
                fit=None if d.get("fit") is None else Fit.from_untrusted(d["fit"]),
                largest=None
                if d.get("largest") is None
                else SearchResult.from_untrusted(d["largest"]),
                trainable_count=None
                if d.get("trainable_count") is None
                else int(d["trainable_count"]),
                undecided=_text(d.get("undecided", ""), 1000),
                step_flops=None if d.get("step_flops") is None else int(d["step_flops"]),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise EstimateError(f"estimate: malformed ({_text(exc, 200)})") from None


def _text(v: Any, n: int) -> str:
    """A string from the file, inert (no terminal escapes) and bounded."""
    return inert(str(v))[:n]


def _tree(v: Any) -> Any:
    """The spec as read: every string in it inert (it is printed in the headline)."""
    if isinstance(v, dict):
        return {_text(k, 256): _tree(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_tree(x) for x in v]
    return _text(v, 256) if isinstance(v, str) else v


def _parts(v: Any, what: str) -> dict[str, int]:
    if not isinstance(v, dict) or not all(
        isinstance(k, str) and isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 50
        for k, x in v.items()
    ):
        raise EstimateError(f"estimate: {what} must map names to byte counts")
    return {k: int(x) for k, x in v.items()}


def _bytes(v: Any, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 50:
        raise EstimateError(f"estimate: {what} must be a byte count")
    return v


def _share(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
        raise EstimateError(f"estimate: {what} must be a number from 0 to 1")
    return float(v)


def _object(d: Any, what: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise EstimateError(f"estimate: {what} must be an object")
    return d


def _module(m: Any) -> ModulePeak:
    return ModulePeak(
        _text(m["module"], 256),
        _text(m["phase"], 16),
        int(m["total"]),
        _parts(m["parts"], "a module's parts"),
    )


MAX_ESTIMATE_BYTES = 64 << 20  # an estimate of the 7B is 60 KB


def load_estimate(path: Path) -> Estimate:
    """The estimate in ``path`` (``stepmem estimate --out``), checked: a regular file, bounded,
    JSON without NaN or Infinity, shallow (:func:`collector.model.untrusted.read_json`)."""
    try:
        doc = read_json(path, MAX_ESTIMATE_BYTES, f"estimate {path}")
    except OSError as exc:
        raise EstimateError(f"estimate {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise EstimateError(str(exc)) from None
    return Estimate.from_dict(doc)

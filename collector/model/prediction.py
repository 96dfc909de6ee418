"""An estimate as it crosses boundaries: what ``stepmem estimate`` writes (``--out``), what a
probe given ``STEPMEM_ESTIMATE`` reads its predicted peak from, and what ``report --estimate``
holds a run against. Made by :mod:`collector.estimate`; a file somebody else wrote is data,
checked here and never executed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from collector.model.errors import EstimateError

__all__ = ["FORMAT", "Estimate", "ModulePeak", "load_estimate"]

FORMAT = 1


@dataclass
class ModulePeak:
    """A module's peak in one pass: device bytes by :class:`collector.model.kinds.MemoryKind`
    at that moment."""

    module: str
    phase: str  # "forward" | "backward"
    total: int
    parts: dict[str, int]


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

    @property
    def peak(self) -> int:
        return sum(self.steady.values())

    @property
    def first_peak(self) -> int:
        return sum(self.first.values())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Estimate:
        """An estimate from its JSON; anything malformed is an :class:`EstimateError`."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise EstimateError("not a stepmem estimate (format 1)")
        try:
            return cls(
                spec=dict(d["spec"]),
                device=str(d["device"])[:64],
                stand_in=bool(d["stand_in"]),
                parameters_count=int(d["parameters_count"]),
                steady=_parts(d["steady"], "steady"),
                first=_parts(d["first"], "first"),
                at_end=_parts(d["at_end"], "at_end"),
                optimizer_state_managed=int(d.get("optimizer_state_managed", 0)),
                peak_module=str(d.get("peak_module", ""))[:256],
                peak_phase=str(d.get("peak_phase", ""))[:16],
                modules=[_module(m) for m in d.get("modules", [])[:10_000]],
                notes=[str(x)[:500] for x in d.get("notes", [])][:50],
                stopped_at=str(d.get("stopped_at", ""))[:256],
                seconds=float(d.get("seconds", 0.0)),
                torch=str(d.get("torch", ""))[:64],
                device_allocated=(
                    int(d["device_allocated"]) if d.get("device_allocated") is not None else None
                ),
                unsharded_peak=int(d.get("unsharded_peak", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise EstimateError(f"estimate: malformed ({exc})") from None


def _parts(v: Any, what: str) -> dict[str, int]:
    if not isinstance(v, dict) or not all(
        isinstance(k, str) and isinstance(x, int) and not isinstance(x, bool) and x >= 0
        for k, x in v.items()
    ):
        raise EstimateError(f"estimate: {what} must map names to byte counts")
    return {k: int(x) for k, x in v.items()}


def _module(m: Any) -> ModulePeak:
    return ModulePeak(
        str(m["module"])[:256],
        str(m["phase"]),
        int(m["total"]),
        _parts(m["parts"], "a module's parts"),
    )


def load_estimate(path: Path) -> Estimate:
    """The estimate in ``path`` (``stepmem estimate --out``), checked."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise EstimateError(f"estimate {path}: {exc.strerror or exc}") from None
    try:
        return Estimate.from_dict(json.loads(text))
    except json.JSONDecodeError as exc:
        raise EstimateError(f"estimate {path}: not JSON ({exc.msg})") from None

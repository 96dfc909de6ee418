"""What a finding can be: its kind, how much it matters, and the thresholds each rule uses,
declared once, each with one meaning."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from collector.model.units import MIB

__all__ = [
    "LINE",
    "THRESHOLDS",
    "Finding",
    "FindingKind",
    "Pool",
    "Severity",
    "Thresholds",
    "fits",
]


LINE = 147  # the report's width less a finding's bullet


def fits(text: str, lines: int = 2) -> bool:
    """Whether ``text`` fits the report in ``lines`` lines."""
    import textwrap

    return len(textwrap.wrap(text, LINE)) <= lines


class Severity(Enum):
    INFO = "info"  # how the run used memory
    WARNING = "warning"  # something to look at: memory that should not be there, lost figures
    CRITICAL = "critical"  # the run failed, or will: an OOM, a leak


@dataclass(frozen=True)
class Thresholds:
    """Every threshold a rule uses, each with one meaning (bytes unless named otherwise)."""

    # growth.py: end-of-step memory that moves less than this a step is steady
    steady_bytes: int = 64 * MIB
    # growth.py: live tensors that grow at least this much over the run, and at least this
    # share of the fastest-growing pool, are a leak
    leak_share: float = 0.25
    # growth.py: the pool named for growth is the most specific one growing at least this share
    # of the fastest
    pool_share: float = 0.8
    # jumps.py: an end-of-step increase of torch reserved above this is a jump
    jump_bytes: int = 256 * MIB
    # jumps.py: two growths match (a jump explained by the peak or by live tensors) within this
    # share of the jump, or within match_bytes
    match_fraction: float = 0.15
    match_bytes: int = 128 * MIB
    # jumps.py: a jump whose allocated peak grew at least this share of it is the peak's (what
    # reserved grew beyond the peak is said with it); less, and it is the allocator's
    peak_share: float = 0.5
    # jumps.py: a ledger kind that grew this much in the step before a jump "appeared"
    new_state_bytes: int = 256 * MIB
    # jumps.py: without a ledger, torch allocated kept by a step beyond this is named
    kept_bytes: int = 256 * MIB
    # outside.py: managed (paged) optimizer state above this is named as the memory outside
    managed_bytes: int = 256 * MIB
    # outside.py: memory outside torch that appeared on first use (NCCL, cuBLAS) named above
    first_use_bytes: int = 64 * MIB
    # transients.py: a step whose NVML peak exceeds its end reading by this much (and
    # transient_share of it) had a transient
    transient_bytes: int = 256 * MIB
    transient_share: float = 0.05
    # transients.py: memory outside torch at a peak, gone by the step's end, named above
    transient_outside_bytes: int = 256 * MIB
    # cache.py: allocator-made reserved growth (no new tensors) that makes fragmentation
    fragmentation_bytes: int = 256 * MIB
    # cache.py: inactive split blocks at least this share of reserved (and the noise floor)
    split_share: float = 0.05
    # everywhere: a component under the noise floor (the smaller of this and floor_share of the
    # card) is left out of a finding's text unless --verbose
    floor_bytes: int = 128 * MIB
    floor_share: float = 0.005
    # fleet.py: a rank whose allocated peak lies this share above the median rank's, and at
    # least imbalance_bytes above it, is out of balance
    imbalance_share: float = 0.05
    imbalance_bytes: int = 256 * MIB

    def floor(self, total_bytes: int | None) -> int:
        """The smaller of ``floor_bytes`` and ``floor_share`` of the card (a small card's noise
        is smaller)."""
        if not total_bytes:
            return self.floor_bytes
        return min(self.floor_bytes, int(self.floor_share * total_bytes))


THRESHOLDS = Thresholds()


class Pool(str, Enum):
    """Where end-of-step memory grows, from the most specific to the least (the growth
    rule's finding names one)."""

    __str__ = str.__str__
    __format__ = str.__format__

    ALLOCATED = "torch allocated"  # live tensors
    RESERVED = "torch reserved"  # the allocator's pool
    OUTSIDE = "outside the allocator"
    NVML = "NVML used"


class FindingKind(Enum):
    """Each kind of finding with its severity. ``rule`` (the value's first part) is the name
    records of findings and tests use."""

    EMPTY = ("empty", Severity.WARNING)
    UNMEASURED = ("unmeasured", Severity.WARNING)
    STARVED = ("starved", Severity.WARNING)
    STEADY = ("steady_state", Severity.INFO)
    LEAK = ("leak", Severity.CRITICAL)
    GROWING = ("growing", Severity.WARNING)
    UNSTEADY = ("unsteady", Severity.INFO)
    JUMP = ("jump", Severity.INFO)
    FRAGMENTATION = ("fragmentation", Severity.WARNING)
    NONTORCH = ("nontorch", Severity.INFO)
    ALLOCATOR_MODE = ("allocator_mode", Severity.INFO)
    ACCOUNTING = ("accounting", Severity.INFO)
    COMPONENT_CHANGE = ("component_change", Severity.WARNING)
    CACHE = ("cache", Severity.INFO)
    TRANSIENT = ("transient", Severity.INFO)
    HEADROOM = ("headroom", Severity.INFO)
    OOM = ("oom", Severity.CRITICAL)
    FAILED = ("failed", Severity.CRITICAL)
    INTERRUPTED = ("interrupted", Severity.WARNING)
    IMBALANCE = ("imbalance", Severity.WARNING)

    @property
    def rule(self) -> str:
        return self.value[0]

    @property
    def severity(self) -> Severity:
        return self.value[1]


@dataclass
class Finding:
    """One thing the report says: at most two lines (``text``), the long form for ``--verbose``
    (``detail``, empty: the text says it all), the figures behind it (``numbers``), and the
    steps it is about (``steps``: first and last, for the consistency pass). A ``minor``
    finding (every figure under the noise floor) is shown only with ``--verbose``."""

    kind: FindingKind
    text: str
    numbers: dict[str, Any] = field(default_factory=dict)
    detail: str = ""
    steps: tuple[int, int] | None = None
    minor: bool = False

    @property
    def rule(self) -> str:
        return self.kind.rule

    @property
    def severity(self) -> Severity:
        return self.kind.severity

    def shown(self, verbose: bool) -> str:
        return self.detail if verbose and self.detail else self.text

    def add(self, more: str) -> None:
        """Append ``more`` to the text if it still fits two lines; always to the detail."""
        self.detail = (self.detail or self.text) + more
        if fits(self.text + more):
            self.text += more

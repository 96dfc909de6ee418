"""What memory holds, as one vocabulary: :class:`MemoryKind` (the probe's ledger kinds *and* the
estimate's categories) and :class:`Component` (the parts of a step's account, every byte of NVML
used at its end).

PyTorch's ``torch.distributed._tools.mem_tracker._MemRefType`` is the pattern: a ``str`` enum with
one documented member per kind. Members are strings (``MemoryKind.PARAMETERS == "parameters"``),
so a ledger read from a run store keys the same way it was written; each member says which roles
it plays (:attr:`MemoryKind.roles`), and the selections every reader uses are derived from that
here (:data:`LEDGER_KINDS`, :data:`LIVE_KINDS`, :data:`ESTIMATE_KINDS`). A new kind is one member
line plus its use.
"""

from __future__ import annotations

from enum import Enum

__all__ = [
    "ESTIMATE_KINDS",
    "LEDGER_KINDS",
    "LIVE_KINDS",
    "Component",
    "Gap",
    "LedgerFigure",
    "MemoryKind",
    "Phase",
]

# roles a kind plays
COUNTED = "counted"  # the probe's ledger counts it from the model's and optimizer's tensors
LIVE = "live"  # a live tensor in torch's pool at a step's end (``other_allocated`` is the rest)
ESTIMATED = "estimated"  # a category of `stepmem estimate`'s account


class _Vocabulary(str, Enum):
    """A ``str`` enum whose members format as their value (``f"{kind}"`` is ``"parameters"``)."""

    __str__ = str.__str__
    __format__ = str.__format__


class MemoryKind(_Vocabulary):
    """What a byte of memory holds. ``roles``: see the module docstring."""

    def __new__(cls, value: str, doc: str, *roles: str) -> MemoryKind:
        obj = str.__new__(cls, value)
        obj._value_ = value
        obj.__doc__ = doc
        obj.roles = frozenset(roles)  # type: ignore[attr-defined]
        return obj

    PARAMETERS = (
        "parameters",
        "The model's parameters (under FSDP2 a rank's local shards).",
        COUNTED,
        LIVE,
        ESTIMATED,
    )
    BUFFERS = ("buffers", "The model's buffers (rotary tables, norms' running figures).", ESTIMATED)
    GRADIENTS = (
        "gradients",
        "Parameters' gradients (FSDP2: the local shards).",
        COUNTED,
        LIVE,
        ESTIMATED,
    )
    OPTIMIZER_STATE = (
        "optimizer_state",
        "Optimizer state tensors on the device (AdamW's moments; bitsandbytes' 8-bit state and "
        "absmax).",
        COUNTED,
        LIVE,
        ESTIMATED,
    )
    OPTIMIZER_STATE_MANAGED = (
        "optimizer_state_managed",
        "Paged optimizer state in CUDA managed memory (bitsandbytes' CPU tensors marked "
        "``is_paged``): outside torch's pool; NVML's device figure counts it once its pages sit "
        "on the GPU, its per-process figure never does.",
        COUNTED,
    )
    GRADIENT_BUCKETS = (
        "gradient_buckets",
        "DDP's gradient buckets when they are a second copy of the gradients "
        "(``gradient_as_bucket_view=False``); 0 when the gradients are views into them.",
        COUNTED,
        LIVE,
    )
    OTHER_ALLOCATED = (
        "other_allocated",
        "Torch allocated at a step's end less the ledger's live kinds: activations kept, "
        "temporaries, caches.",
    )
    OPTIMIZER_STEP_TEMPORARIES = (
        "optimizer_step_temporaries",
        "What the optimizer step allocates and frees again (foreach AdamW's intermediates).",
        ESTIMATED,
    )
    UNSHARDED_PARAMETERS = (
        "unsharded_parameters",
        "FSDP2's all-gathered parameters, resident only while their module runs.",
        ESTIMATED,
    )
    UNSHARDED_GRADIENTS = (
        "unsharded_gradients",
        "FSDP2's unsharded gradients before their reduce-scatter.",
        ESTIMATED,
    )
    COMMUNICATION = (
        "communication",
        "Collectives' buffers (all-gather, reduce-scatter).",
        ESTIMATED,
    )
    ACTIVATIONS = (
        "activations",
        "Tensors forward saves for backward (inputs included).",
        ESTIMATED,
    )
    TEMPORARIES = ("temporaries", "Tensors made and freed inside an operator or module.", ESTIMATED)
    OTHER = ("other", "What torch's tracker files under no other kind.", ESTIMATED)

    @property
    def words(self) -> str:
        """The kind in a sentence or a table's first column: ``"optimizer state"``."""
        return self.value.replace("_", " ")


LEDGER_KINDS: tuple[MemoryKind, ...] = tuple(k for k in MemoryKind if COUNTED in k.roles)
LIVE_KINDS: tuple[MemoryKind, ...] = tuple(k for k in MemoryKind if LIVE in k.roles)
ESTIMATE_KINDS: tuple[MemoryKind, ...] = tuple(k for k in MemoryKind if ESTIMATED in k.roles)


class LedgerFigure(_Vocabulary):
    """Figures a ledger carries beside its kinds: sizes, not bytes of a kind held at the end."""

    BUCKET_BYTES = "gradient_bucket_bytes"
    """DDP's bucket bytes, whether the gradients are views into them or not."""
    UNSHARDED_PEAK = "unsharded_parameters_peak"
    """FSDP2: the most parameter bytes all-gathered at once during the step."""


class Component(_Vocabulary):
    """A part of NVML used at a step's end (:class:`collector.model.account.Account`): the
    value is how the report names it, :attr:`label` the ``component`` label of
    ``stepmem_step_account_bytes``."""

    def __new__(cls, value: str, label: str) -> Component:
        obj = str.__new__(cls, value)
        obj._value_ = value
        obj.label = label  # type: ignore[attr-defined]
        return obj

    BASELINE = ("baseline", "baseline")
    TORCH_RESERVED = ("torch reserved", "torch_reserved")
    FIRST_USE = ("first use", "first_use")
    OUTSIDE_TORCH = ("outside torch, this process", "outside_torch")
    OTHER_PROCESSES = ("other processes", "other_processes")
    NO_PROCESS = ("no process (managed/UVM)", "no_process")
    OUTSIDE_UNSPLIT = ("outside torch (unsplit)", "outside_torch_unsplit")
    REMAINDER = ("remainder", "remainder")


class Phase(_Vocabulary):
    """A part of a training step, one spelling each: what the probe marks inside a step (its
    adapters, and a user's own ``probe.phase(name)``, which may name others), what the join and
    the allocation history read, and what the estimate traces. torch's ``_ModState`` is the
    pattern (the estimate maps its members, not their strings: :mod:`collector.estimate.tracing`).
    """

    FORWARD_BACKWARD = "forward_backward"
    """From a step's begin to its first phase mark (the probe's implicit first phase)."""
    FORWARD = "forward"
    """A module's (or a micro-batch's) forward pass."""
    BACKWARD = "backward"
    """A module's (or a micro-batch's) backward pass."""
    OPTIMIZER = "optimizer"
    """``optimizer.step()`` (and ``zero_grad``): the adapters' mark, the estimate's last phase."""
    STEP = "step"
    """A script's step under the estimate, from its begin mark to its first phase mark."""
    BUILD = "build"
    """Before the first step: the model and optimizer built (the estimate's log)."""
    END = "end"
    """A step's end mark (the estimate's log)."""

    @classmethod
    def read(cls, text: str) -> Phase | str:
        """A phase as a file spells it: a member (``"optimizer step"``, the estimate's spelling
        before #36, is :attr:`OPTIMIZER`), else the name a user gave it, as it is."""
        text = "optimizer" if text == "optimizer step" else text
        try:
            return cls(text)
        except ValueError:
            return text


class Gap(_Vocabulary):
    """Why a step's NVML figures may fall short (a record's ``gap`` holds them space-separated;
    see :class:`collector.model.step.StepRecord`)."""

    NO_SAMPLES = "no_samples"
    SAMPLER_STARTED = "sampler_started"
    OVERRUN = "overrun"
    STALL = "stall"
    HOLE = "hole"
    UNDERSAMPLED = "undersampled"
    STALE_END = "stale_end"
    # CPU processes stood in for a replayed GPU: its NVML is a capture playing beside them,
    # not their memory, so their steps carry no NVML figure
    STAND_IN = "stand_in"

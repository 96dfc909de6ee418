"""``stepmem estimate``: a training step's memory predicted before it runs, per component and per
module, from fake tensors and torch's own tracker.

The model is built and trained for two optimizer steps under
:class:`torch._subclasses.fake_tensor.FakeTensorMode` (shapes, dtypes and devices, no storage:
nothing is allocated on any device) while :class:`torch.distributed._tools.mem_tracker.MemTracker`
files every tensor as torch does (parameters, buffers, gradients, activations, temporaries,
optimizer state) and keeps each module's forward and backward peaks. Two steps, because
optimizer state created by step 1's optimizer step is resident in step 2's forward and backward:
step 2's peak is the steady one, and step 1's is lower by about that state.

What stepmem adds to torch's tracker, and says where it does:

* **bitsandbytes' 8-bit optimizers** (``adamw_8bit``, ``paged_adamw_8bit``) cannot run on fake
  tensors (their update is a CUDA kernel). A stand-in optimizer creates exactly the state
  tensors ``bitsandbytes.optim.optimizer.Optimizer2State.init_state`` creates (uint8 state1 and
  state2 for tensors of at least 4,096 elements, float32 ``absmax`` per block of 256, float32
  state below that size and for ``nn.Embedding`` weights, which the Hugging Face Trainer keeps
  in 32 bits) and is tracked by MemTracker like any optimizer.
* **Paged state** (``paged_adamw_8bit``: state of tensors of 10^5 elements or more) lives in CUDA
  managed memory, outside torch's pool: it is predicted as ``optimizer_state_managed``, apart
  from the device total, because NVML counts it once its pages sit on the GPU and torch never
  does.
* Without a GPU (CI) the fake tensors live on the CPU device, standing in for CUDA: byte counts
  are the same; CPU autocast casts a few ops differently from CUDA's and attention takes the
  CPU kernel, so activations are an approximation there (said in the estimate).

Memory that no tracker can predict (the CUDA context, cuBLAS workspaces, NCCL buffers, the
allocator's cached-free and inactive-split bytes, other processes) is what
:func:`reconcile` names from a measured run.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from collector.errors import StepmemError

__all__ = [
    "CATEGORIES",
    "Estimate",
    "EstimateError",
    "ModulePeak",
    "Spec",
    "estimate",
    "load_estimate",
    "reconcile",
]

FORMAT = 1
GIB = 1 << 30
CATEGORIES = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer_state",
    "optimizer_step_temporaries",
    "unsharded_parameters",
    "unsharded_gradients",
    "communication",
    "activations",
    "temporaries",
    "other",
)
# MemTracker's reference types (their string values, stable since torch 2.5) → ours
_TRACKER = {
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "other",
    # FSDPMemTracker's (FSDP2): a rank's shards, the all-gathered copies, the collectives' buffers
    "Sharded Param": "parameters",
    "Unsharded Param": "unsharded_parameters",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "unsharded_gradients",
    "All Gather": "communication",
    "Reduce Scatter": "communication",
    "OptState": "optimizer_state",
    "Inputs": "activations",
}
SHARDS = ("none", "fsdp2")
MAX_WORLD = 1 << 16
OPTIMS = ("adamw_torch", "adamw_8bit", "paged_adamw_8bit")
BNB_MIN_8BIT = 4096  # bitsandbytes: tensors with fewer elements keep float32 state
BNB_BLOCK = 256  # bitsandbytes: one float32 absmax per block of this many elements
BNB_PAGED_MIN = 100_000  # bitsandbytes: tensors at least this large get paged state
BNB_QMAP = 256 * 4 * 2  # the two shared quantisation maps (256 float32 each)
MAX_SEQ = 1 << 20
MAX_STEPS_TRACED = 2
MODULE_DEPTH = 4  # module names kept in the per-module account (Model.model.layers.N)


class EstimateError(StepmemError):
    """The estimate cannot be made: one line, exit 2."""


@dataclass(frozen=True)
class Spec:
    """What is estimated: a Llama shape or a Hugging Face config, an optimizer, a batch."""

    workload: str = "finetune"
    size: str | None = "tiny"
    config: dict[str, Any] | None = None  # a Hugging Face config (model_type and its fields)
    optim: str = "adamw_torch"
    seq_len: int = 64
    batch: int = 1
    grad_accum: int = 2
    checkpointing: bool = True
    bf16: bool = True
    shard: str = "none"  # "fsdp2": every decoder layer and the root fully_shard-ed
    world_size: int = 1  # ranks the model is sharded over (one rank is estimated)
    keep_grads: bool = False  # zero_grad(set_to_none=False): gradients stay between steps

    def validate(self) -> None:
        if self.optim not in OPTIMS:
            raise EstimateError(f"optimizer {self.optim!r}: one of {', '.join(OPTIMS)}")
        if self.shard not in SHARDS:
            raise EstimateError(f"shard {self.shard!r}: one of {', '.join(SHARDS)}")
        w = self.world_size
        if not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= MAX_WORLD:
            raise EstimateError(f"world size must be a whole number from 1 to {MAX_WORLD}")
        if self.shard == "fsdp2" and self.optim != "adamw_torch":
            raise EstimateError(
                "bitsandbytes' optimizers under FSDP2 are not modelled: estimate with adamw_torch"
            )
        for name in ("seq_len", "batch", "grad_accum"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_SEQ:
                raise EstimateError(f"{name} must be a whole number from 1 to {MAX_SEQ}")
        if self.config is None and self.size is None:
            raise EstimateError("a model: a built-in size or a Hugging Face config")


@dataclass
class ModulePeak:
    """A module's peak in one pass: device bytes by category at that moment."""

    module: str
    phase: str  # "forward" | "backward"
    total: int
    parts: dict[str, int]


@dataclass
class Estimate:
    """A prediction. Byte figures are per device (the model's one device); ``steady`` is step 2's
    peak by category, ``first`` step 1's; ``at_end`` what stays resident after a step
    (parameters, buffers, optimizer state: the ledger's figures at a step end)."""

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
        """An estimate from its JSON; anything malformed is an :class:`EstimateError` (a file
        somebody else wrote is data: checked, never executed)."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise EstimateError("not a stepmem estimate (format 1)")

        def parts(v: Any, what: str) -> dict[str, int]:
            if not isinstance(v, dict) or not all(
                isinstance(k, str) and isinstance(x, int) and not isinstance(x, bool) and x >= 0
                for k, x in v.items()
            ):
                raise EstimateError(f"estimate: {what} must map names to byte counts")
            return {k: int(x) for k, x in v.items()}

        try:
            mods = [
                ModulePeak(
                    str(m["module"])[:256],
                    str(m["phase"]),
                    int(m["total"]),
                    parts(m["parts"], "a module's parts"),
                )
                for m in d.get("modules", [])[:10_000]
            ]
            return cls(
                spec=dict(d["spec"]),
                device=str(d["device"])[:64],
                stand_in=bool(d["stand_in"]),
                parameters_count=int(d["parameters_count"]),
                steady=parts(d["steady"], "steady"),
                first=parts(d["first"], "first"),
                at_end=parts(d["at_end"], "at_end"),
                optimizer_state_managed=int(d.get("optimizer_state_managed", 0)),
                peak_module=str(d.get("peak_module", ""))[:256],
                peak_phase=str(d.get("peak_phase", ""))[:16],
                modules=mods,
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


def load_estimate(path: Path) -> Estimate:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise EstimateError(f"estimate {path}: {exc.strerror or exc}") from None
    try:
        return Estimate.from_dict(json.loads(text))
    except json.JSONDecodeError as exc:
        raise EstimateError(f"estimate {path}: not JSON ({exc.msg})") from None


# -- the model ---------------------------------------------------------------------------------


def _model(spec: Spec) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if spec.config is not None:
        cfg = dict(spec.config)
        kind = cfg.pop("model_type", None)
        if not isinstance(kind, str):
            raise EstimateError("the config needs its model_type (as config.json has it)")
        try:  # the config is data; whatever transformers refuses in it is the user's to fix
            config = AutoConfig.for_model(kind, **cfg)
        except Exception as exc:
            why = " ".join(str(exc).split())[:300]
            raise EstimateError(
                f"config: transformers could not build its config ({why})"
            ) from None
        config.use_cache = False
        try:
            return AutoModelForCausalLM.from_config(config)
        except Exception as exc:
            why = " ".join(str(exc).split())[:300]
            raise EstimateError(f"config: transformers could not build its model ({why})") from None
    from workloads.finetune import SHAPES

    if spec.size not in SHAPES:
        raise EstimateError(f"size {spec.size!r}: one of {', '.join(sorted(SHAPES))}")
    config = LlamaConfig(
        **SHAPES[spec.size], max_position_embeddings=max(spec.seq_len, 128), use_cache=False
    )
    return LlamaForCausalLM(config)


def _bnb_stand_in(params_and_embedding: list[tuple[Any, bool]], paged: bool) -> Any:
    """An optimizer whose state has bitsandbytes' 8-bit AdamW layout (see the module doc); its
    step updates nothing (the real update is one fused kernel without temporaries)."""
    import torch

    class BnbStateLayout(torch.optim.Optimizer):
        def __init__(self) -> None:
            super().__init__([p for p, _ in params_and_embedding], {"lr": 0.0})
            self.embedding = {id(p) for p, emb in params_and_embedding if emb}
            self.managed = 0
            self.qmap: Any = None

        @torch.no_grad()
        def step(self, closure: Callable[[], Any] | None = None) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None or self.state[p]:
                        continue
                    st = self.state[p]
                    st["step"] = 0  # a Python int in bitsandbytes' state
                    n = p.numel()
                    eight = n >= BNB_MIN_8BIT and id(p) not in self.embedding
                    dtype = torch.uint8 if eight else torch.float32
                    for key in ("state1", "state2"):
                        if paged and n >= BNB_PAGED_MIN:  # managed memory, outside the pool
                            self.managed += n * (1 if eight else 4)
                        else:
                            st[key] = torch.zeros_like(p, dtype=dtype)
                    if eight:
                        if self.qmap is None:
                            self.qmap = torch.zeros(BNB_QMAP // 4, device=p.device)
                        st["qmap"] = self.qmap
                        blocks = math.ceil(n / BNB_BLOCK)
                        st["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                        st["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)

    return BnbStateLayout()


def _optimizer(spec: Spec, model: Any) -> Any:
    import torch

    if spec.optim == "adamw_torch":
        # foreach=True: CUDA's default (the CPU's is False); its temporaries are what a GPU sees
        return torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    embedding = {
        id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)
    }  # the HF Trainer registers 32-bit state for these (GlobalOptimManager override)
    params = [(p, id(p) in embedding) for p in model.parameters() if p.requires_grad]
    return _bnb_stand_in(params, paged=spec.optim == "paged_adamw_8bit")


# -- tracing -----------------------------------------------------------------------------------


def _parts(snap: dict[Any, dict[Any, int]], device: Any) -> dict[str, int]:
    """One device's bytes by category (optimizer step counters live on the host under CUDA)."""
    out = dict.fromkeys(CATEGORIES, 0)
    for dev, dev_snap in snap.items():
        if dev != device:
            continue
        for k, v in dev_snap.items():
            name = _TRACKER.get(str(getattr(k, "value", k)))
            if name:
                out[name] += int(v)
    return out


def _module_peaks(tracker: Any, root: str, device: Any) -> list[ModulePeak]:
    out = []
    for stats in list(tracker.memory_tracking.values()):
        name = stats.mod_fqn
        if name.count(".") >= MODULE_DEPTH or name.split(".")[0] != root:
            continue  # deeper than the account keeps, or an autograd Function ("Func")
        for state, snaps in stats.snapshots.items():
            phase = {
                "Peak-Forward": "forward",  # MemTracker's
                "Peak-Backward": "backward",
                "Peak Forward": "forward",  # FSDPMemTracker's
                "Peak Backward": "backward",
            }.get(str(getattr(state, "value", state)))
            if phase is None:
                continue
            for snap in snaps:
                parts = _parts(snap, device)
                out.append(ModulePeak(name, phase, sum(parts.values()), parts))
    return out


class _Stack:
    """The module whose forward runs now (global forward hooks): what stopped a trace."""

    def __init__(self, model: Any) -> None:
        import torch

        self.names = {m: n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._pre),
            torch.nn.modules.module.register_module_forward_hook(self._post),
        ]

    def _pre(self, module: Any, args: Any) -> None:
        self.stack.append(f"{self.names.get(module, '?')} ({type(module).__name__})")

    def _post(self, module: Any, args: Any, out: Any) -> None:
        if self.stack:
            self.stack.pop()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _static_parts(model: Any, opt: Any, spec: Spec) -> dict[str, int]:
    """Parameters, gradients and optimizer state from shapes alone (an untraceable model)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if spec.optim == "adamw_torch":
        state = sum(2 * p.numel() * p.element_size() for p in model.parameters())
    else:
        state = 0
        for p in model.parameters():
            n = p.numel()
            state += 2 * n if n >= BNB_MIN_8BIT else 8 * n
            state += 8 * math.ceil(n / BNB_BLOCK) if n >= BNB_MIN_8BIT else 0
    out = dict.fromkeys(CATEGORIES, 0)
    out.update(parameters=params, gradients=grads, optimizer_state=state)
    return out


def estimate(
    spec: Spec,
    progress: Callable[[str], None] | None = None,
    *,
    build: Callable[[], Any] | None = None,
    fake: bool = True,
) -> Estimate:
    """Predict ``spec``'s step memory (see the module doc). Never allocates device memory.

    ``build`` makes the model instead of ``spec``'s size or config (called on the fake device;
    the model takes ``input_ids`` and ``labels`` and returns an object with ``.loss``, as a
    Hugging Face causal LM does). ``fake=False`` runs the same trace on real tensors (tests
    hold the fake trace to it)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    spec.validate()
    say = progress or (lambda _msg: None)
    t0 = time.monotonic()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    notes: list[str] = []
    if not cuda:
        notes.append(
            "no GPU here: fake tensors on the CPU stand in for CUDA (same bytes; CPU autocast "
            "and attention kernels differ, so activations are approximate)"
        )
    if spec.optim != "adamw_torch":
        notes.append(
            f"{spec.optim}: bitsandbytes' state layout added by stepmem (uint8 moments, float32 "
            "absmax per 256 elements, float32 below 4,096 elements and for embeddings)"
            + (
                "; state of tensors of 10^5 elements or more is paged (CUDA managed memory, "
                "outside torch's pool)"
                if spec.optim == "paged_adamw_8bit"
                else ""
            )
        )
    stopped = ""
    mesh = None
    if spec.shard == "fsdp2":
        mesh = _fake_group(spec.world_size, device)
        notes.append(
            f"FSDP2 at world size {spec.world_size}: one rank traced over a fake process group "
            "(torch's FakeStore), under torch's FSDPMemTracker"
        )
    mode = FakeTensorMode(allow_non_fake_inputs=False) if fake else contextlib.nullcontext()
    with mode, warnings.catch_warnings(), _group_closed(mesh), contextlib.ExitStack() as more:
        # ModTracker warns on every recomputed (checkpointed) forward; deprecations are noise
        warnings.filterwarnings("ignore", message=".*module hierarchy tracking")
        warnings.filterwarnings("ignore", category=FutureWarning)
        say("building the model on fake tensors")
        with torch.device(device):
            model = build() if build is not None else _model(spec)
        if spec.checkpointing:  # as the HF Trainer does (transformers 5 renamed it)
            enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
                model, "gradient_checkpointing_enable", None
            )
            if enable is not None:
                enable()
        if _attention_is_math(spec, cuda, device, model):
            more.enter_context(_math_sdpa())
            notes.append(
                "attention traced on PyTorch's math kernel, which keeps each layer's attention "
                "probabilities for backward: "
                + (
                    "CUDA's dispatcher picks it here for this dtype and head layout"
                    if cuda
                    else "CUDA's pick for float32 attention with grouped key/value heads (no "
                    "fused kernel takes both; measured on the H200, torch 2.11)"
                )
            )
        if mesh is not None:
            from torch.distributed.fsdp import fully_shard

            for layer in _layers(model):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        model.train()
        opt = _optimizer(spec, model)
        n_params = sum(p.numel() for p in model.parameters())
        vocab = _vocab(model)
        per_step: list[dict[str, int]] = []
        at_end: dict[str, int] = {}
        best: tuple[int, list[ModulePeak]] = (-1, [])
        in_optimizer = False  # whether step 2's peak is in its optimizer step
        unsharded = 0
        root = type(model).__name__
        stack = _Stack(model)
        try:
            for step in range(1, MAX_STEPS_TRACED + 1):
                if mesh is not None:
                    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

                    tracker = FSDPMemTracker(model, opt)
                    tracker.track_inputs(())
                else:
                    tracker = MemTracker()
                    tracker.track_external(model, opt)
                with tracker:
                    for micro in range(spec.grad_accum):
                        say(f"tracing step {step}, micro-batch {micro + 1}/{spec.grad_accum}")
                        tracker.reset_mod_stats()  # one forward per module per record
                        ids = torch.randint(0, vocab, (spec.batch, spec.seq_len), device=device)
                        with torch.autocast(device.type, torch.bfloat16, enabled=spec.bf16):
                            loss = model(input_ids=ids, labels=ids).loss
                        (loss / spec.grad_accum).backward()
                        del loss
                        peak = sum(_parts(tracker.get_tracker_snapshot("peak"), device).values())
                        if step == MAX_STEPS_TRACED and peak > best[0]:
                            best = (peak, _module_peaks(tracker, root, device))
                        if step == MAX_STEPS_TRACED:
                            unsharded = max(unsharded, _most_unsharded(tracker, device))
                    before = sum(_parts(tracker.get_tracker_snapshot("peak"), device).values())
                    say(f"tracing step {step}'s optimizer step")
                    opt.step()
                    model.zero_grad(set_to_none=not spec.keep_grads)
                    parts = _parts(tracker.get_tracker_snapshot("peak"), device)
                    in_optimizer = sum(parts.values()) > before
                    at_end = _parts(tracker.get_tracker_snapshot("current"), device)
                    # torch files every allocation of the optimizer step as optimizer state;
                    # what is not resident after it was the step's temporaries
                    extra = max(0, parts["optimizer_state"] - at_end["optimizer_state"])
                    parts["optimizer_state"] -= extra
                    parts["optimizer_step_temporaries"] += extra
                    per_step.append(parts)
        except Exception as exc:  # an op fake tensors cannot run (data-dependent shapes, …)
            stopped = stack.stack[-1] if stack.stack else type(model).__name__
            line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            notes.append(
                f"{stopped} could not be traced on fake tensors ({type(exc).__name__}: {line} "
                f"at {Path(frame.filename).name}:{frame.lineno}): parameters, gradients and "
                "optimizer state are from shapes; activations and temporaries are not estimated"
            )
            static = _static_parts(model, opt, spec)
            per_step = [static, static]
            at_end = dict(static, gradients=0)
        finally:
            stack.close()
    managed = int(getattr(opt, "managed", 0))
    if not cuda:  # torch's step counters live on the host under CUDA: not the device's bytes
        counters = _step_counters(opt)
        for d in (*per_step, at_end):
            if d.get("optimizer_state", 0) >= counters:
                d["optimizer_state"] -= counters
    steady = per_step[-1]
    mods = best[1]
    holder = None if in_optimizer else _holder(mods, sum(steady.values()))
    return Estimate(
        spec=asdict(spec),
        device=str(device),
        stand_in=not cuda,
        parameters_count=int(n_params),
        steady=steady,
        first=per_step[0],
        at_end={
            k: at_end.get(k, 0)
            for k in ("parameters", "buffers", "optimizer_state")
            + (("gradients",) if spec.keep_grads else ())
        },
        optimizer_state_managed=managed,
        peak_module=holder.module if holder else "",
        peak_phase=holder.phase if holder else ("optimizer step" if in_optimizer else ""),
        modules=mods,
        notes=notes,
        stopped_at=stopped,
        seconds=round(time.monotonic() - t0, 2),
        torch=torch.__version__,
        device_allocated=int(torch.cuda.max_memory_allocated(device)) if cuda else None,
        unsharded_peak=unsharded,
    )


def _attention_is_math(spec: Spec, cuda: bool, device: Any, model: Any) -> bool:
    """Whether scaled-dot-product attention runs PyTorch's math kernel in the real step. Fake
    tensors pass a fused kernel's shape rules even where the real dispatcher has no kernel (on
    the H200, torch 2.11: float32 with grouped key/value heads, which flash refuses for the
    dtype and the memory-efficient kernel for the grouping), so on a GPU the dispatcher is asked
    with a few real bytes of this model's head layout; without one, that rule stands in."""
    import torch

    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        return False  # not a transformer config stepmem can read: trace what fake tensors take
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    dim = getattr(cfg, "head_dim", None) or getattr(cfg, "hidden_size", heads) // heads
    gqa = kv != heads
    if not cuda:
        return gqa and not spec.bf16
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.nn.attention import SDPBackend

        dtype = torch.bfloat16 if spec.bf16 else torch.float32
        with unset_fake_temporarily():
            q = torch.zeros(1, heads, 16, dim, device=device, dtype=dtype)
            k = torch.zeros(1, kv, 16, dim, device=device, dtype=dtype)
            choice = torch._fused_sdp_choice(q, k, k, None, 0.0, True, scale=None, enable_gqa=gqa)
        return int(choice) == int(SDPBackend.MATH)
    except Exception:  # a torch without the probe: trace what fake tensors take
        return False


@contextlib.contextmanager
def _math_sdpa() -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield


def _most_unsharded(tracker: Any, device: Any) -> int:
    """The most unsharded-parameter bytes in any module snapshot FSDPMemTracker took (what the
    probe's UnshardWatch reads on a real run: the all-gathered copies at their own peak)."""
    most = 0
    for stats in list(getattr(tracker, "memory_tracking", {}).values()):
        for snaps in stats.snapshots.values():
            for snap in snaps:
                most = max(most, _parts(snap, device)["unsharded_parameters"])
    return most


def _step_counters(opt: Any) -> int:
    """Bytes of the optimizer's per-parameter ``step`` tensors (CPU scalars unless capturable)."""
    import torch

    total = 0
    for st in opt.state.values():
        v = st.get("step")
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def _fake_group(world: int, device: Any) -> Any:
    """A fake process group of ``world`` ranks (this process rank 0) and its device mesh, made
    before fake tensors are on (the mesh reads real tensors)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise EstimateError(
            "an FSDP2 estimate needs a process without a process group (run it on its own)"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    return init_device_mesh(device.type, (world,))


@contextlib.contextmanager
def _group_closed(mesh: Any) -> Any:
    try:
        yield
    finally:
        if mesh is not None:
            import torch.distributed as dist

            dist.destroy_process_group()


def _layers(model: Any) -> list[Any]:
    """The repeated blocks FSDP2 shards one by one: the longest ModuleList (a causal LM's
    decoder layers)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _vocab(model: Any) -> int:
    """Token ids to draw from: the config's vocabulary, else the first embedding's rows."""
    import torch

    v = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(v, int) and v > 0:
        return v
    emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return int(emb.num_embeddings) if emb is not None else 2


def _holder(mods: list[ModulePeak], peak: int) -> ModulePeak | None:
    """The innermost module whose pass holds the step's peak (the deepest name at that total)."""
    at = [m for m in mods if m.total >= peak]
    if not at:
        return max(mods, key=lambda m: m.total) if mods else None
    return max(at, key=lambda m: m.module.count("."))


# -- text --------------------------------------------------------------------------------------


def _g(b: int | float) -> str:
    return f"{b / GIB:.2f}"


def _unit(peak: int) -> tuple[int, str]:
    return (GIB, "GiB") if peak >= GIB else (1 << 20, "MiB")


def render(est: Estimate, top: int = 8) -> str:
    s = est.spec
    div, unit = _unit(est.peak)

    def f(b: int | float) -> str:
        return f"{b / div:.2f}"

    model = f"a {s['config'].get('model_type', '?')} config" if s.get("config") else s["size"]
    if s.get("shard") == "fsdp2":
        model += f", FSDP2 over {s.get('world_size', 1)} rank(s)"
    lines = [
        f"Estimate: {model} ({est.parameters_count / 1e9:.2f}B parameters), {s['optim']}, "
        f"batch {s['batch']} × {s['seq_len']} tokens, {s['grad_accum']} "
        f"micro-batch{'es' if s['grad_accum'] > 1 else ''} a step"
        f"{', checkpointing' if s['checkpointing'] else ''}{', bf16 autocast' if s['bf16'] else ''}"
        f" — on {est.device}{' (standing in for CUDA)' if est.stand_in else ''}, "
        f"{est.seconds:.1f} s, "
        + (
            "no device memory used"
            if est.device_allocated is None
            else f"{est.device_allocated} B allocated on the GPU by torch"
        ),
        "",
        f"{f'component ({unit})':<28}{'step 1 peak':>12}{'step 2 peak':>12}{'step end':>10}",
    ]
    for k in CATEGORIES:
        a, b = est.first.get(k, 0), est.steady.get(k, 0)
        if a == b == 0:
            continue
        end = est.at_end.get(k)
        lines.append(
            f"{k.replace('_', ' '):<28}{f(a):>12}{f(b):>12}{'' if end is None else f(end):>10}"
        )
    lines.append(
        f"{'device total':<28}{f(est.first_peak):>12}{f(est.peak):>12}"
        f"{f(sum(est.at_end.values())):>10}"
    )
    if est.optimizer_state_managed:
        lines.append(
            f"{'+ managed (paged) state':<28}{'':>12}{f(est.optimizer_state_managed):>12}"
            f"{f(est.optimizer_state_managed):>10}   outside torch's pool; NVML counts it"
        )
    jump = est.peak - est.first_peak
    if jump > 0 and est.first.get("optimizer_state", 0) < est.steady.get("optimizer_state", 0):
        lines.append(
            f"Step 2's peak is {f(jump)} {unit} above step 1's: optimizer state created by step "
            "1's optimizer step is resident during step 2's forward and backward."
        )
    if est.peak_phase == "optimizer step":
        lines.append(
            "The peak is in the optimizer step: parameters, gradients and state, with the "
            f"step's temporaries ({f(est.steady.get('optimizer_step_temporaries', 0))} {unit})."
        )
    elif est.peak_module:
        holder = next(
            m for m in est.modules if m.module == est.peak_module and m.phase == est.peak_phase
        )
        where = (
            " (outside its submodules: the loss, or code between them)"
            if "." not in est.peak_module
            else ""
        )
        lines.append(
            f"The peak is held in {est.peak_module}'s {est.peak_phase} pass{where}: activations "
            f"{f(holder.parts.get('activations', 0))} {unit}, temporaries "
            f"{f(holder.parts.get('temporaries', 0))} {unit} at that moment."
        )
    if est.modules:
        lines.append("")
        lines.append(f"Largest module peaks ({unit}; top {top} of step 2's last micro-batch):")
        for m in sorted(est.modules, key=lambda m: -m.total)[:top]:
            lines.append(
                f"  {m.module:<48} {m.phase:<9}{f(m.total):>9}   activations "
                f"{f(m.parts.get('activations', 0))}, temporaries "
                f"{f(m.parts.get('temporaries', 0))}"
            )
    if est.stopped_at:
        lines.append(f"Stopped at {est.stopped_at}: the rest of the model was not traced.")
    for n in est.notes:
        lines.append(f"Note: {n}.")
    return "\n".join(lines)


# -- reconciliation ----------------------------------------------------------------------------


@dataclass
class Row:
    component: str
    predicted: int | None
    measured: int | None
    explains: str = ""

    @property
    def difference(self) -> int | None:
        if self.predicted is None or self.measured is None:
            return None
        return self.measured - self.predicted


def reconcile(est: Estimate, records: list[Any]) -> tuple[list[Row], list[str]]:
    """Predicted against measured for one GPU's records (typed StepRecords of one process):
    rows of the table and the differences named with the measurement that explains them."""
    from collector.accounting import accounts
    from collector.records import Stat

    recs = [r for r in records if not r.failed and r.has_torch]
    if not recs:
        return [], ["no measured step with allocator figures: nothing to reconcile"]
    steady = recs[1] if len(recs) > 1 else recs[0]
    first = recs[0]
    led = steady.ledger
    rows = [
        Row("parameters", est.at_end.get("parameters"), led.get("parameters")),
        Row(
            "optimizer state (device)",
            est.at_end.get("optimizer_state"),
            led.get("optimizer_state"),
        ),
        Row(
            "optimizer state (managed)",
            est.optimizer_state_managed,
            led.get("optimizer_state_managed", 0) if led else None,
        ),
        *(
            [Row("gradients (kept between steps)", est.at_end["gradients"], led.get("gradients"))]
            if "gradients" in est.at_end
            else []
        ),
        *(
            [
                Row(
                    "unsharded parameters at their peak (FSDP2 all-gather)",
                    est.unsharded_peak or est.steady.get("unsharded_parameters", 0),
                    led["unsharded_parameters_peak"],
                    "measured: the probe's watch of FSDP2's unshard",
                )
            ]
            if "unsharded_parameters_peak" in led
            else []
        ),
        Row("step 1 allocated peak", est.first_peak, first.torch_allocated_peak_bytes),
        Row(
            f"step {steady.step} allocated peak",
            est.peak,
            steady.torch_allocated_peak_bytes,
        ),
    ]
    named: list[str] = []
    alloc_peak = steady.torch_allocated_peak_bytes
    if alloc_peak is not None and led:
        persistent = sum(est.steady.get(k, 0) for k in ("parameters", "buffers"))
        persistent += est.at_end.get("optimizer_state", 0)
        measured_rest = alloc_peak - led.get("parameters", 0) - led.get("optimizer_state", 0)
        predicted_rest = est.peak - persistent
        rows.append(
            Row(
                "gradients + activations + temporaries at the peak",
                predicted_rest,
                measured_rest,
                "measured: allocated peak − parameters − optimizer state (ledger)",
            )
        )
        off = measured_rest - predicted_rest
        if predicted_rest > 0 and abs(off) > 0.05 * predicted_rest:
            named.append(
                f"Activations and temporaries at step {steady.step}'s peak: {_g(off)} GiB "
                f"{'more' if off > 0 else 'less'} than predicted ({off / predicted_rest:+.0%})"
                + (
                    ": this estimate ran on the CPU standing in for CUDA, whose attention and "
                    "autocast kernels save different tensors; `stepmem estimate` on a GPU "
                    "machine traces CUDA's kernels (fake tensors: no device memory used)."
                    if est.stand_in
                    else ": kernels or code paths the trace did not take (a different attention "
                    "implementation, a different batch)."
                )
            )
    jump_p = est.peak - est.first_peak
    if first is not steady and first.torch_allocated_peak_bytes is not None and alloc_peak:
        jump_m = alloc_peak - first.torch_allocated_peak_bytes
        if jump_p > 0 or jump_m > 0:
            state = est.at_end.get("optimizer_state", 0)
            kept = est.at_end.get("gradients", 0)
            what = f"optimizer state ({_g(state)} GiB on the device)" + (
                f" and the gradients kept from step 1 ({_g(kept)} GiB)" if kept else ""
            )
            named.append(
                f"Step 1 → step {steady.step}: allocated peak +{_g(jump_m)} GiB measured, "
                f"+{_g(jump_p)} GiB predicted: {what} — made after step 1's forward/backward, "
                "resident in every later step's forward and backward."
            )
    res_peak = steady.torch_reserved_peak_bytes
    if res_peak is not None and alloc_peak is not None:
        split = steady.end_stat(Stat.INACTIVE_SPLIT) or 0
        rows.append(
            Row(
                "allocator cache at the peak (reserved − allocated)",
                0,
                res_peak - alloc_peak,
                f"not predictable by a tracker: cached-free blocks; {_g(split)} GiB in inactive "
                "split blocks at step end",
            )
        )
    managed = steady.managed
    if managed or est.optimizer_state_managed:
        named.append(
            f"Managed (paged) optimizer state: {_g(managed)} GiB measured, "
            f"{_g(est.optimizer_state_managed)} GiB predicted — outside torch's pool: torch's "
            "figures never show it, NVML counts it once its pages sit on the GPU."
        )
    acc = next((a for a in accounts(recs) if a.step == steady.step), None)
    if acc is not None:
        first_use = acc.first_use
        rows.append(
            Row(
                "this process outside torch (CUDA context, cuBLAS, NCCL)",
                0,
                acc.baseline + (acc.outside or 0),
                f"at step {steady.step}'s end; of it {_g(first_use)} GiB appeared on first use "
                "(workspaces, communicator buffers)",
            )
        )
        if acc.unsplit is None:
            rows.append(
                Row(
                    "CUDA managed memory, charged to no process",
                    est.optimizer_state_managed,
                    acc.no_process or 0,
                    "paged optimizer state lives here",
                )
            )
            rows.append(Row("other processes on the GPU", 0, acc.other_processes))
        else:
            rows.append(
                Row(
                    "outside torch beyond the baseline (no per-process reading)",
                    est.optimizer_state_managed,
                    acc.unsplit,
                    "managed memory and other processes together",
                )
            )
    if steady.nvml_peak_bytes is not None:
        rows.append(
            Row(
                f"NVML used, step {steady.step}'s within-step peak",
                est.peak + est.optimizer_state_managed,
                steady.nvml_peak_bytes,
                "what nvidia-smi shows: everything above",
            )
        )
    for row in rows[:3] + [r for r in rows if r.component.startswith("gradients (kept")]:
        d = row.difference
        if d is not None and row.predicted and abs(d) > 0.05 * row.predicted:
            named.append(
                f"{row.component}: predicted {_g(row.predicted)} GiB, measured "
                f"{_g(row.measured or 0)} GiB ({d / row.predicted:+.1%}): the run's model or "
                "optimizer is not the one estimated?"
            )
    return rows, named


def render_reconciliation(est: Estimate, rows: list[Row], named: list[str]) -> str:
    lines = [
        "Predicted vs measured (GiB; estimate of "
        f"{est.spec.get('size') or 'a config'}, {est.spec.get('optim')})",
        f"  {'component':<58}{'predicted':>10}{'measured':>10}{'diff':>9}{'':>9}",
    ]
    for r in rows:
        p = "—" if r.predicted is None else _g(r.predicted)
        m = "—" if r.measured is None else _g(r.measured)
        d = r.difference
        pct = f"{d / r.predicted:+.1%}" if d is not None and r.predicted else ""
        lines.append(
            f"  {r.component:<58}{p:>10}{m:>10}{'' if d is None else f'{d / GIB:+.2f}':>9}{pct:>9}"
        )
        if r.explains:
            lines.append(f"  {'':<4}{r.explains}")
    lines.extend(f" • {n}" for n in named)
    return "\n".join(lines)

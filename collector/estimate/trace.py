"""The trace: a training step's memory predicted before it runs, per kind and per module, from
fake tensors and torch's own tracker.

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
* **What the GPU holds**, not only what tensors hold: every storage's creation and release is
  logged in program order (:class:`~collector.estimate.alloc_log.AllocationLog`) and played
  through a model of PyTorch's caching allocator (:mod:`collector.estimate.allocator`), which
  gives torch's *reserved* bytes through each phase — the cache and split blocks no tracker
  sees. NVML's figure adds this process's memory outside torch (the CUDA context and what loads
  on first use: :mod:`collector.estimate.gpus`) and paged state.
* **Without a GPU** (CI) the fake tensors live on the CPU device, standing in for CUDA, and
  follow CUDA's rules (:mod:`collector.estimate.cuda_rules`): CUDA autocast's cast lists and
  the attention kernel CUDA's dispatcher would pick. On a GPU, fake CUDA tensors take CUDA's own
  autocast, and the attention kernel is asked of the real dispatcher.

Memory the estimate does not model (another process, a second stream's pool, kernels' internal
workspaces other than cuBLAS's) is what :func:`collector.analysis.predicted_vs_measured.reconcile`
names from a measured run.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import collector.estimate.build as build
import collector.estimate.cuda_rules as cuda_rules
from collector.estimate.alloc_log import AllocationLog
from collector.estimate.allocator import AllocatorConfig
from collector.estimate.fakes import (
    Reads,
    conversions_in_place,
    data_follows_device,
    fake_mode,
    parameter_subclasses,
)
from collector.estimate.fit import Target
from collector.estimate.flops import FlopCount
from collector.estimate.limits import bounded_build
from collector.estimate.spec import Spec
from collector.estimate.tracing import (
    MAX_STEPS_TRACED,
    MICRO_TRACED,
    attention_note,
    hold_steps,
    holder_of,
    index_peaks,
    module_peaks,
    parts_of,
    quiet,
    step_counters,
)
from collector.estimate.tracker import exact_bytes, file_quantisation_state
from collector.estimate.tracker import tracker as memory_tracker
from collector.model.kinds import MemoryKind, Phase
from collector.model.prediction import Estimate, ModulePeak
from collector.model.quantised import parameter_counts

__all__ = ["estimate"]


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


def _most_unsharded(tracker: Any, device: Any) -> int:
    """The most unsharded-parameter bytes in any module snapshot FSDPMemTracker took (what the
    probe's UnshardWatch reads on a real run: the all-gathered copies at their own peak)."""
    most = 0
    for stats in list(getattr(tracker, "memory_tracking", {}).values()):
        for snaps in stats.snapshots.values():
            for snap in snaps:
                most = max(most, parts_of(snap, device)[MemoryKind.UNSHARDED_PARAMETERS])
    return most


def _notes(spec: Spec, cuda: bool) -> list[str]:
    """What the estimate says about itself before it traces anything."""
    notes: list[str] = []
    if not cuda:
        notes.append(
            "no GPU here: fake tensors on the CPU stand in for CUDA, with CUDA's autocast cast "
            "lists and the attention kernel CUDA's dispatcher picks"
        )
    if spec.checkpointing:  # no flag turns it on: it is always the workload's default here
        notes.append(
            "the step is the finetune workload's (an HF Trainer's): activation checkpointing on "
            "by default — --no-checkpointing"
            + (" --grad-accum 1" if spec.grad_accum > 1 else "")
            + " estimates a plain loop"
        )
    if spec.grad_accum > MICRO_TRACED:
        notes.append(
            f"{MICRO_TRACED} of the {spec.grad_accum} micro-batches of a step traced: from the "
            "second on, each holds what the one before held"
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
    if spec.shard == "fsdp2":
        notes.append(
            f"FSDP2 at world size {spec.world_size}: one rank traced over a fake process group "
            "(torch's FakeStore), under torch's FSDPMemTracker"
            + (
                "; the finetune step under FSDP2 (checkpointing, bf16 autocast) has not been run "
                "on a GPU by stepmem: the distributed workload's FSDP2 figures have"
                if spec.workload == "finetune"
                else ""
            )
        )
    return notes


@dataclass
class _Trace:
    """What tracing the steps found: each step's peak by kind, what stays at the end, step
    2's module peaks, whether its peak is in the optimizer step, FSDP2's unsharded peak, and
    the module that stopped it (empty: none)."""

    per_step: list[dict[MemoryKind, int]] = field(default_factory=list)
    at_end: dict[MemoryKind, int] = field(default_factory=dict)
    best: tuple[int, list[ModulePeak]] = (-1, [])
    in_optimizer: bool = False
    unsharded: int = 0
    stopped: str = ""
    tracker: Any = None  # the step's tracker (its module stack names where memory is taken)
    log: AllocationLog | None = None
    flops: FlopCount | None = None  # the trace's FLOP counter (None: real tensors)


def _prepare(spec: Spec, model: Any, mesh: Any) -> None:
    """Checkpointing and FSDP2 sharding, as the real loop sets them up."""
    if spec.checkpointing:  # as the HF Trainer does (transformers 5 renamed it)
        enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
            model, "gradient_checkpointing_enable", None
        )
        if enable is not None:
            enable()
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in build.layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.train()


def _cuda_rules(spec: Spec, cuda: bool, device: Any, more: Any) -> Any:
    """CUDA's rules for the fake trace: on the CPU stand-in CUDA autocast's cast lists and CUDA's
    fused dropout; on both the attention kernel CUDA would run. Returns the attention mode (its
    ``chosen`` counts)."""
    import torch

    dtype = torch.bfloat16 if spec.bf16 else None
    if not cuda and dtype is not None:
        more.enter_context(cuda_rules.cuda_autocast(dtype))
    if not cuda:
        more.enter_context(cuda_rules.cuda_dropout())
    choose = cuda_rules.dispatcher_choice(device) if cuda else cuda_rules.rules_choice
    return more.enter_context(cuda_rules.CudaAttention(dtype, choose))


def _tracker(mesh: Any, model: Any, opt: Any) -> Any:
    if mesh is not None:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs(())
    else:
        tracker = memory_tracker()
        tracker.track_external(model, opt)
        file_quantisation_state(tracker, [model])
    index_peaks(tracker)
    return tracker


def _trace_step(
    step: int, spec: Spec, model: Any, opt: Any, device: Any, mesh: Any, t: _Trace, say: Any
) -> None:
    """Step ``step``: its micro-batches' forward and backward, then the optimizer step, under a
    tracker of its own; what it found goes into ``t``, each phase's start into ``t.log``."""
    import torch

    root, last = type(model).__name__, step == MAX_STEPS_TRACED
    vocab = build.vocab(model)
    mark = t.log.mark if t.log is not None else (lambda _p: None)
    tracker = t.tracker = _tracker(mesh, model, opt)
    with tracker:
        for micro in range(min(spec.grad_accum, MICRO_TRACED)):
            say(f"tracing step {step}, micro-batch {micro + 1}/{spec.grad_accum}")
            tracker.reset_mod_stats()  # one forward per module per record
            mark(f"{step} {Phase.FORWARD} {micro + 1}")
            ids = torch.randint(0, vocab, (spec.batch, spec.seq_len), device=device)
            counted = t.flops if last and micro == 0 and t.flops is not None else None
            with counted or contextlib.nullcontext():  # one micro-batch's FLOPs are counted
                with torch.autocast(device.type, torch.bfloat16, enabled=spec.bf16):
                    loss = model(input_ids=ids, labels=ids).loss
                mark(f"{step} {Phase.BACKWARD} {micro + 1}")
                (loss / spec.grad_accum).backward()
            del loss, ids
            peak = sum(parts_of(tracker.get_tracker_snapshot("peak"), device).values())
            if last and peak > t.best[0]:
                t.best = (peak, module_peaks(tracker, root, device))
            if last:
                t.unsharded = max(t.unsharded, _most_unsharded(tracker, device))
        before = sum(parts_of(tracker.get_tracker_snapshot("peak"), device).values())
        say(f"tracing step {step}'s optimizer step")
        mark(f"{step} {Phase.OPTIMIZER}")
        opt.step()
        model.zero_grad(set_to_none=not spec.keep_grads)
        parts = parts_of(tracker.get_tracker_snapshot("peak"), device)
        t.in_optimizer = sum(parts.values()) > before
        t.at_end = parts_of(tracker.get_tracker_snapshot("current"), device)
        # torch files every allocation of the optimizer step as optimizer state;
        # what is not resident after it was the step's temporaries
        state = MemoryKind.OPTIMIZER_STATE
        extra = max(0, parts[state] - t.at_end[state])
        parts[state] -= extra
        parts[MemoryKind.OPTIMIZER_STEP_TEMPORARIES] += extra
        t.per_step.append(parts)
    t.tracker = None
    mark(f"{step} {Phase.END}")


def _untraceable(exc: Exception, stack: Any, model: Any, opt: Any, spec: Spec, t: _Trace) -> str:
    """An op fake tensors cannot run (a data-dependent shape, …): the module it stopped in,
    named, and the figures shapes alone give. Returns the note saying so."""
    t.stopped = stack.stack[-1] if stack.stack else type(model).__name__
    line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    static = build.static_parts(model, opt, spec)
    t.per_step = [static, static]
    t.at_end = dict(static)
    t.at_end[MemoryKind.GRADIENTS] = 0
    t.log = None  # a partial sequence says nothing of the step's reserved bytes
    return (
        f"{t.stopped} could not be traced on fake tensors ({type(exc).__name__}: {line} "
        f"at {Path(frame.filename).name}:{frame.lineno}): parameters, gradients and "
        "optimizer state are from shapes; activations and temporaries are not estimated"
    )


def _fakes(more: Any, spec: Spec, cuda: bool, device: Any, mesh: Any, t: _Trace) -> Any:
    """The fake trace's rules, entered on ``more``: CUDA's (:func:`_cuda_rules`, whose attention
    mode is returned), the libraries' tensors on fake storage and the allocation log; and a FLOP
    counter (torch's FLOP formulas, shapes only: :class:`~collector.estimate.flops.FlopCount`)
    for :func:`_trace_step` to enter."""
    attention = _cuda_rules(spec, cuda, device, more)
    more.enter_context(build.unpacked_inputs())
    more.enter_context(parameter_subclasses())  # bitsandbytes' 4-bit weights
    more.enter_context(conversions_in_place())  # peft's adapters moved with .to()
    more.enter_context(data_follows_device())
    if mesh is not None:
        more.enter_context(build.own_propagation_mode())
    assert t.log is not None
    more.enter_context(t.log.resizes())
    more.enter_context(t.log.streams_followed(cuda))
    more.enter_context(t.log.mode())
    t.flops = FlopCount()  # entered for one micro-batch: _trace_step
    t.log.mark(Phase.BUILD)
    return attention


def _where(t: _Trace, stack: list[_Stack]) -> Callable[[], str]:
    """What runs now: the deepest module of the tracker's stack (forward and backward), else of
    the forward hooks' stack."""

    def now() -> str:
        parents = getattr(getattr(t.tracker, "_mod_tracker", None), "parents", None)
        if parents:
            deepest = max(parents, key=lambda n: (n.count("."), len(n)))
            if deepest != "Global":
                return deepest
        return stack[0].stack[-1] if stack and stack[0].stack else ""

    return now


def estimate(
    spec: Spec,
    progress: Callable[[str], None] | None = None,
    *,
    build_model: Callable[[], Any] | None = None,
    fake: bool = True,
    allocator: AllocatorConfig | None = None,
    target: Target | None = None,
    logs: list[AllocationLog] | None = None,
) -> Estimate:
    """Predict ``spec``'s step memory (see the module doc). Never allocates device memory.

    ``build_model`` makes the model instead of ``spec``'s size or config (called on the fake
    device; the model takes ``input_ids`` and ``labels`` and returns an object with ``.loss``,
    as a Hugging Face causal LM does). ``fake=False`` runs the same trace on real tensors (tests
    hold the fake trace to it). ``allocator``: the caching allocator's settings (default:
    ``PYTORCH_CUDA_ALLOC_CONF``'s); ``target``: the GPU the step is held against (whether it fits,
    and where it would first run out); ``logs``: the allocation log is appended to it (a plan
    holds it again under other settings: :func:`collector.estimate.tracing.hold_steps`)."""
    import torch

    spec.validate()
    allocator = allocator if allocator is not None else AllocatorConfig.from_env()
    say = progress or (lambda _msg: None)
    t0 = time.monotonic()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    notes = _notes(spec, cuda)
    mesh = build.fake_group(spec.world_size, device) if spec.shard == "fsdp2" else None
    # values read (bitsandbytes building its quantisation maps) answered with placeholders
    mode = fake_mode(Reads(), allow_real=False) if fake else contextlib.nullcontext()
    t = _Trace()
    stack: list[_Stack] = []
    if fake:
        t.log = AllocationLog(device, where_now=_where(t, stack))
    with mode, quiet(), exact_bytes(), build.group_closed(mesh), contextlib.ExitStack() as more:
        attention = _fakes(more, spec, cuda, device, mesh, t) if fake else None
        say("building the model on fake tensors")
        with torch.device(device), bounded_build(spec.size or "--config"):
            model = build_model() if build_model is not None else build.build_model(spec, device)
        _prepare(spec, model, mesh)
        opt = build.optimizer(spec, model)
        n_params = parameter_counts(model.parameters())
        stack.append(_Stack(model))
        try:
            for step in range(1, MAX_STEPS_TRACED + 1):
                _trace_step(step, spec, model, opt, device, mesh, t, say)
        except Exception as exc:  # an op fake tensors cannot run (data-dependent shapes, …)
            notes.append(_untraceable(exc, stack[0], model, opt, spec, t))
        finally:
            stack[0].close()
        counters = step_counters(opt) if not cuda else []
        if t.log is not None:
            t.log.drop({k for k in map(t.log.key_of, counters) if k is not None})
    if counters:  # torch's step counters live on the host under CUDA: not the device's bytes
        n = sum(c.numel() * c.element_size() for c in counters)
        for d in (*t.per_step, t.at_end):
            if d.get(MemoryKind.OPTIMIZER_STATE, 0) >= n:
                d[MemoryKind.OPTIMIZER_STATE] -= n
    notes += attention_note(getattr(attention, "chosen", {}))
    out = _result(spec, t, notes, device, cuda, n_params, opt, time.monotonic() - t0)
    if t.log is not None:
        hold_steps(out, t.log, allocator, target)
        if logs is not None:
            logs.append(t.log)
    return out


def _result(
    spec: Spec,
    t: _Trace,
    notes: list[str],
    device: Any,
    cuda: bool,
    n_params: tuple[int, int],
    opt: Any,
    seconds: float,
) -> Estimate:
    import torch

    steady = t.per_step[-1]
    mods = t.best[1]
    holder = None if t.in_optimizer else holder_of(mods, sum(steady.values()))
    resident = (MemoryKind.PARAMETERS, MemoryKind.BUFFERS, MemoryKind.OPTIMIZER_STATE)
    if spec.keep_grads:
        resident += (MemoryKind.GRADIENTS,)
    return Estimate(
        spec={**asdict(spec), "lora_targets": list(spec.lora_targets)},  # as JSON has it
        device=str(device),
        stand_in=not cuda,
        parameters_count=n_params[0],
        trainable_count=n_params[1],
        steady=steady,
        first=t.per_step[0],
        at_end={k: t.at_end.get(k, 0) for k in resident},
        optimizer_state_managed=int(getattr(opt, "managed", 0)),
        peak_module=holder.module if holder else "",
        peak_phase=holder.phase if holder else (Phase.OPTIMIZER if t.in_optimizer else ""),
        modules=mods,
        notes=notes,
        stopped_at=t.stopped,
        seconds=round(seconds, 2),
        torch=torch.__version__,
        device_allocated=int(torch.cuda.max_memory_allocated(device)) if cuda else None,
        unsharded_peak=t.unsharded,
        step_flops=_step_flops(spec, t),
    )


def _step_flops(spec: Spec, t: _Trace) -> int | None:
    """One optimizer step's FLOPs: the last traced step's first micro-batch (forward and
    backward, a recomputed forward included) times the step's micro-batches — every micro-batch
    does the same work. None: not counted, or the trace stopped."""
    if t.flops is None or t.stopped or len(t.per_step) < MAX_STEPS_TRACED:
        return None
    return int(t.flops.total * spec.grad_accum)

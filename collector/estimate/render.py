"""An estimate as text: what was estimated, the step's peaks by kind (step 1, step 2, what
stays), where the peak is held, what the GPU will hold (torch's allocated and reserved, NVML's
figure) and whether it fits the card, and the largest module peaks."""

from __future__ import annotations

from collections.abc import Callable

from collector.model.kinds import ESTIMATE_KINDS, MemoryKind, Phase
from collector.model.prediction import Estimate
from collector.model.units import GIB, MIB

__all__ = ["render"]


def _unit(peak: int) -> tuple[int, str]:
    return (GIB, "GiB") if peak >= GIB else (MIB, "MiB")


def _what(est: Estimate) -> str:
    """The model, optimizer and batch estimated (a script's: its arguments and probe steps)."""
    s = est.spec
    if est.script:
        args = " ".join(s.get("args") or [])
        return (
            f"{est.subject}{' ' + args[:120] if args else ''}, optimizer {s.get('optim')}, "
            f"through its probe steps {', '.join(map(str, s.get('steps') or []))}"
        )
    adapted = ""
    if s.get("load_in_4bit"):
        adapted += ", 4-bit NF4 base"
    if s.get("lora_r"):
        targets = ",".join(s.get("lora_targets") or []) or "every projection"
        adapted += f", LoRA r={s['lora_r']} on {targets}"
    return (
        f"{s['optim']}{adapted}, batch {s['batch']} × {s['seq_len']} tokens, {s['grad_accum']} "
        f"micro-batch{'es' if s['grad_accum'] > 1 else ''} a step"
        f"{', checkpointing' if s['checkpointing'] else ''}{', bf16 autocast' if s['bf16'] else ''}"
    )


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _headline(est: Estimate) -> str:
    s = est.spec
    model = str(s.get("model") or "") if est.script else est.subject  # a script's: its class
    if s.get("shard") == "fsdp2":
        model += f", FSDP2 over {s.get('world_size', 1)} rank(s)"
    count = f"{_count(est.parameters_count)} parameters"
    trainable = est.trainable_count
    if trainable is not None and trainable < est.parameters_count:
        count += f", {_count(trainable)} trainable"
    return (
        f"Estimate: {model + ' ' if model else ''}({count}), {_what(est)}"
        f" — on {est.device}{' (standing in for CUDA)' if est.stand_in else ''}, "
        f"{est.seconds:.1f} s, "
        + (
            "no device memory used"
            if est.device_allocated is None
            else f"{est.device_allocated} B allocated on the GPU by torch"
        )
    )


def _table(est: Estimate, f: Callable[[float], str], unit: str) -> list[str]:
    lines = [f"{f'component ({unit})':<28}{'step 1 peak':>12}{'step 2 peak':>12}{'step end':>10}"]
    for k in ESTIMATE_KINDS:
        a, b = est.first.get(k, 0), est.steady.get(k, 0)
        if a == b == 0:
            continue
        end = est.at_end.get(k)
        lines.append(f"{k.words:<28}{f(a):>12}{f(b):>12}{'' if end is None else f(end):>10}")
    lines.append(
        f"{'device total':<28}{f(est.first_peak):>12}{f(est.peak):>12}"
        f"{f(sum(est.at_end.values())):>10}"
    )
    if est.optimizer_state_managed:
        lines.append(
            f"{'+ managed (paged) state':<28}{'':>12}{f(est.optimizer_state_managed):>12}"
            f"{f(est.optimizer_state_managed):>10}   outside torch's pool; NVML counts it"
        )
    return lines


def _where(est: Estimate, f: Callable[[float], str], unit: str) -> list[str]:
    """Why step 2 peaks above step 1, and where its peak is held."""
    lines = []
    if est.largest_step == 1:
        lines.append(
            f"Step 1's peak ({f(est.first_peak)} {unit}) is the largest of the steps traced, "
            f"{f(est.first_peak - est.peak)} {unit} above step 2's: the figures below are step 2's."
        )
    jump = est.peak - est.first_peak
    state = MemoryKind.OPTIMIZER_STATE
    if jump > 0 and est.first.get(state, 0) < est.steady.get(state, 0):
        lines.append(
            f"Step 2's peak is {f(jump)} {unit} above step 1's: optimizer state created by step "
            "1's optimizer step is resident during step 2's forward and backward."
        )
    if est.peak_phase == Phase.OPTIMIZER:
        temporaries = est.steady.get(MemoryKind.OPTIMIZER_STEP_TEMPORARIES, 0)
        lines.append(
            "The peak is in the optimizer step: parameters, gradients and state, with the "
            f"step's temporaries ({f(temporaries)} {unit})."
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
            f"{f(holder.parts.get(MemoryKind.ACTIVATIONS, 0))} {unit}, temporaries "
            f"{f(holder.parts.get(MemoryKind.TEMPORARIES, 0))} {unit} at that moment."
        )
    return lines


def _held(est: Estimate, f: Callable[[float], str], unit: str) -> list[str]:
    """What the GPU will hold per traced step, and whether it fits the card."""
    if not est.steps:
        return []
    steps = est.steps
    extra = est.outside_torch + est.optimizer_state_managed
    lines = [
        "",
        f"What the GPU will hold ({unit}; PyTorch's caching allocator modelled: {est.allocator}):",
        f"{'':<28}" + "".join(f"{'step ' + str(x.step) + ' peak':>12}" for x in steps),
        f"{'torch allocated':<28}" + "".join(f"{f(x.allocated_peak):>12}" for x in steps),
        f"{'torch reserved':<28}" + "".join(f"{f(x.reserved_peak):>12}" for x in steps),
        f"{'NVML used':<28}" + "".join(f"{f(x.reserved_peak + extra):>12}" for x in steps),
    ]
    paged = (
        f" + paged state {f(est.optimizer_state_managed)}" if est.optimizer_state_managed else ""
    )
    top = max(steps, key=lambda x: x.reserved_peak)
    lines.append(
        f"NVML = reserved + {f(est.outside_torch)} outside torch ({est.outside_source}){paged}; "
        f"the reserved peak is step {top.step}'s, in its {top.reserved_peak_phase}."
    )
    lines += _fit(est, f, unit)
    return lines


def _fit(est: Estimate, f: Callable[[float], str], unit: str) -> list[str]:
    fit, card = est.fit, est.card
    if not fit or not card:
        return ["No GPU named (--gpu NAME|GIB): whether it fits was not judged."]
    margin = f", {fit.margin * 100:g} % kept free" if fit.margin else ""
    fraction = f", memory fraction {fit.fraction:g}" if fit.fraction else ""
    of = (
        f"{f(fit.usable)} {unit} torch may reserve on {card.name} "
        f"({f(card.capacity)} {unit}, less {f(card.driver_reserved)} the driver keeps, "
        f"{f(card.outside_torch)} outside torch{margin}{fraction})"
    )
    if est.undecided:  # the figures are a placeholder's: no verdict on them
        return [f"Cannot say whether it fits on {card.name}: a placeholder decided the figures."]
    if fit.fits and not fit.retries:
        return [f"Fits: needs {f(fit.need)} of {of}; headroom {f(fit.headroom)} {unit}."]
    if fit.fits:
        return [
            f"Fits only by freeing the allocator's cache {fit.retries} time(s) (slower "
            f"steps): the reserved peak {f(fit.need)} is above {of}."
        ]
    step, _, rest = (fit.phase or "").partition(" ")
    when = f"step {step}'s {rest}" if step.isdigit() else "building the model"
    module = f", in {fit.module}" if fit.module else ""
    return [
        f"Does not fit: needs {f(fit.need)} of {of}. It first runs out {when}{module}, "
        f"asking for {f(fit.request or 0)} {unit} ({f(fit.short or 0)} {unit} short)."
    ]


def _largest(est: Estimate) -> list[str]:
    search = est.largest
    if search is None or search.largest is None:
        return []
    axis = "micro-batch" if search.axis == "batch" else "sequence length"
    traced = ", ".join(f"{t.value} {'fits' if t.fits else 'does not'}" for t in search.traced)
    above = [t for t in search.traced if not t.fits and t.value > search.largest]
    nxt = min((t.value for t in above), default=None)
    if nxt is None:
        next_line = " (the search's upper bound: larger was not tried)"
    elif search.converged:
        next_line = f" ({nxt} does not)"
    else:
        next_line = f" ({nxt} does not; the sizes between were not traced)"
    return [
        "",
        f"Largest {axis} that fits: {search.largest}{next_line}. Traced: {traced}.",
    ]


def render(est: Estimate, top: int = 8) -> str:
    div, unit = _unit(est.peak)

    def f(b: float) -> str:
        return f"{b / div:.2f}"

    lines = [_headline(est)]
    if est.undecided:
        lines.append(f"⚠ Not trustworthy: {est.undecided}.")
    lines += ["", *_table(est, f, unit), *_where(est, f, unit)]
    lines += _held(est, f, unit) + _largest(est)
    if est.modules:
        lines.append("")
        lines.append(f"Largest module peaks ({unit}; top {top} of step 2's last micro-batch):")
        for m in sorted(est.modules, key=lambda m: -m.total)[:top]:
            lines.append(
                f"  {m.module:<48} {m.phase:<9}{f(m.total):>9}   activations "
                f"{f(m.parts.get(MemoryKind.ACTIVATIONS, 0))}, temporaries "
                f"{f(m.parts.get(MemoryKind.TEMPORARIES, 0))}"
            )
    if est.stopped_at:
        rest = "the rest of the script" if est.script else "the rest of the model"
        lines.append(f"Stopped at {est.stopped_at}: {rest} was not traced.")
    for n in est.notes:
        lines.append(f"Note: {n}.")
    return "\n".join(lines)

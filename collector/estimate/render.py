"""An estimate as text: what was estimated, the step's peaks by kind (step 1, step 2, what
stays), where the peak is held, and the largest module peaks."""

from __future__ import annotations

from collections.abc import Callable

from collector.model.kinds import ESTIMATE_KINDS, MemoryKind
from collector.model.prediction import Estimate
from collector.model.units import GIB, MIB

__all__ = ["render"]


def _unit(peak: int) -> tuple[int, str]:
    return (GIB, "GiB") if peak >= GIB else (MIB, "MiB")


def _headline(est: Estimate) -> str:
    s = est.spec
    model = f"a {s['config'].get('model_type', '?')} config" if s.get("config") else s["size"]
    if s.get("shard") == "fsdp2":
        model += f", FSDP2 over {s.get('world_size', 1)} rank(s)"
    return (
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
    jump = est.peak - est.first_peak
    state = MemoryKind.OPTIMIZER_STATE
    if jump > 0 and est.first.get(state, 0) < est.steady.get(state, 0):
        lines.append(
            f"Step 2's peak is {f(jump)} {unit} above step 1's: optimizer state created by step "
            "1's optimizer step is resident during step 2's forward and backward."
        )
    if est.peak_phase == "optimizer step":
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


def render(est: Estimate, top: int = 8) -> str:
    div, unit = _unit(est.peak)

    def f(b: float) -> str:
        return f"{b / div:.2f}"

    lines = [_headline(est), "", *_table(est, f, unit), *_where(est, f, unit)]
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
        lines.append(f"Stopped at {est.stopped_at}: the rest of the model was not traced.")
    for n in est.notes:
        lines.append(f"Note: {n}.")
    return "\n".join(lines)

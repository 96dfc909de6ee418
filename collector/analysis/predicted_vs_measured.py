"""``report --estimate``: an estimate (:class:`collector.model.prediction.Estimate`) held against a
measured run, component by component, each difference named with the measurement that
explains it (what a tracker cannot see: the allocator's cache, memory outside torch, managed
memory, other processes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from collector.analysis.accounting import accounts
from collector.model.account import Account
from collector.model.kinds import LedgerFigure, MemoryKind
from collector.model.prediction import Estimate, StepFigures
from collector.model.step import StepRecord
from collector.model.units import GIB, gib_figure

__all__ = ["Reconciliation", "Row", "reconcile", "render_reconciliation"]

OFF_SHARE = 0.05  # a predicted figure this far from the measured one is named
NVML_OFF = 0.03  # NVML's peak this far from the prediction is explained


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


def _stored(est: Estimate, first: StepRecord, steady: StepRecord) -> list[Row]:
    """What the ledger measures against what the estimate predicts to stay, and the peaks."""
    led = steady.ledger
    rows = [
        Row(
            MemoryKind.PARAMETERS.words,
            est.at_end.get(MemoryKind.PARAMETERS),
            led.get(MemoryKind.PARAMETERS),
        ),
        Row(
            "optimizer state (device)",
            est.at_end.get(MemoryKind.OPTIMIZER_STATE),
            led.get(MemoryKind.OPTIMIZER_STATE),
        ),
        Row(
            "optimizer state (managed)",
            est.optimizer_state_managed,
            led.get(MemoryKind.OPTIMIZER_STATE_MANAGED, 0) if led else None,
        ),
    ]
    if MemoryKind.GRADIENTS in est.at_end:
        rows.append(
            Row(
                "gradients (kept between steps)",
                est.at_end[MemoryKind.GRADIENTS],
                led.get(MemoryKind.GRADIENTS),
            )
        )
    if LedgerFigure.UNSHARDED_PEAK in led:
        rows.append(
            Row(
                "unsharded parameters at their peak (FSDP2 all-gather)",
                est.unsharded_peak or est.steady.get(MemoryKind.UNSHARDED_PARAMETERS, 0),
                led[LedgerFigure.UNSHARDED_PEAK],
                "measured: the probe's watch of FSDP2's unshard",
            )
        )
    rows.append(  # the run's own step numbers (a loop may count from 0, or per epoch)
        Row(f"step {first.step} allocated peak", est.first_peak, first.torch_allocated_peak_bytes)
    )
    rows.append(
        Row(f"step {steady.step} allocated peak", est.peak, steady.torch_allocated_peak_bytes)
    )
    return rows


def _rest(est: Estimate, steady: StepRecord) -> tuple[Row | None, str | None]:
    """Gradients, activations and temporaries at the peak: the allocated peak less what the
    ledger says stays; and the sentence naming a difference beyond :data:`OFF_SHARE`."""
    alloc_peak, led = steady.torch_allocated_peak_bytes, steady.ledger
    if alloc_peak is None or not led:
        return None, None
    persistent = sum(est.steady.get(k, 0) for k in (MemoryKind.PARAMETERS, MemoryKind.BUFFERS))
    persistent += est.at_end.get(MemoryKind.OPTIMIZER_STATE, 0)
    measured = (
        alloc_peak - led.get(MemoryKind.PARAMETERS, 0) - led.get(MemoryKind.OPTIMIZER_STATE, 0)
    )
    predicted = est.peak - persistent
    row = Row(
        "gradients + activations + temporaries at the peak",
        predicted,
        measured,
        "measured: allocated peak − parameters − optimizer state (ledger)",
    )
    off = measured - predicted
    if not (predicted > 0 and abs(off) > OFF_SHARE * predicted):
        return row, None
    return row, (
        f"Activations and temporaries at step {steady.step}'s peak: {gib_figure(off)} GiB "
        f"{'more' if off > 0 else 'less'} than predicted ({off / predicted:+.0%})"
        + (
            ": this estimate ran on the CPU standing in for CUDA, whose attention and "
            "autocast kernels save different tensors; `stepmem estimate` on a GPU "
            "machine traces CUDA's kernels (fake tensors: no device memory used)."
            if est.stand_in
            else ": kernels or code paths the trace did not take (a different attention "
            "implementation, a different batch)."
        )
    )


JUMP_AGREE = 0.10  # a measured jump within 10 % (or 256 MiB) of the predicted one is explained
JUMP_AGREE_BYTES = 256 << 20


def _jump(est: Estimate, first: StepRecord, steady: StepRecord) -> str | None:
    """Step 1 → step 2: the peak the optimizer state (and kept gradients) added."""
    alloc_peak = steady.torch_allocated_peak_bytes
    if first is steady or first.torch_allocated_peak_bytes is None or not alloc_peak:
        return None
    jump_p = est.peak - est.first_peak
    jump_m = alloc_peak - first.torch_allocated_peak_bytes
    if not (jump_p > 0 or jump_m > 0):
        return None
    state = est.at_end.get(MemoryKind.OPTIMIZER_STATE, 0)
    kept = est.at_end.get(MemoryKind.GRADIENTS, 0)
    what = f"optimizer state ({gib_figure(state)} GiB on the device)" + (
        f" and the gradients kept from step 1 ({gib_figure(kept)} GiB)" if kept else ""
    )
    head = (
        f"Step 1 → step {steady.step}: allocated peak +{gib_figure(jump_m)} GiB measured, "
        f"+{gib_figure(jump_p)} GiB predicted"
    )
    if abs(jump_m - jump_p) <= max(JUMP_AGREE * max(jump_p, 0), JUMP_AGREE_BYTES):
        return (
            f"{head}: {what} — made after step 1's forward/backward, resident in every later "
            "step's forward and backward."
        )
    # the predicted cause does not explain what was measured: say both, blame neither
    if jump_m < jump_p:
        return (
            f"{head}: the estimate expects {what} after step 1; the run added "
            f"{gib_figure(jump_p - jump_m)} GiB less (state kept off torch's allocator — a "
            "paged optimizer's managed memory — or another optimizer than estimated?)."
        )
    return (
        f"{head}: the run added {gib_figure(jump_m - jump_p)} GiB more than the estimate's "
        f"{what} (another optimizer, or a step 2 that allocates more than step 1?)."
    )


def _modelled(est: Estimate, first: bool) -> StepFigures | None:
    """The allocator model's figures for the first or the steady traced step (None: an
    estimate made before the model)."""
    if not est.steps:
        return None
    return est.steps[0] if first else est.steps[-1]


def _cache(est: Estimate, first: StepRecord, steady: StepRecord) -> list[Row]:
    res_peak, alloc_peak = steady.torch_reserved_peak_bytes, steady.torch_allocated_peak_bytes
    if res_peak is None or alloc_peak is None:
        return []
    held = _modelled(est, first=False)
    if held is None:
        return [
            Row(
                "allocator cache at the peak (reserved − allocated)",
                0,
                res_peak - alloc_peak,
                "not predicted: this estimate was made before stepmem modelled the caching "
                f"allocator; {gib_figure(steady.inactive_split_end)} GiB in inactive split "
                "blocks at step end",
            )
        ]
    rows = []
    one = _modelled(est, first=True)
    if first is not steady and first.torch_reserved_peak_bytes is not None and one is not None:
        rows.append(
            Row(
                f"step {first.step} reserved peak",
                one.reserved_peak,
                first.torch_reserved_peak_bytes,
            )
        )
    rows.append(
        Row(
            f"step {steady.step} reserved peak",
            held.reserved_peak,
            res_peak,
            f"the caching allocator modelled ({est.allocator or 'its defaults'})",
        )
    )
    rows.append(
        Row(
            "allocator cache at the peak (reserved − allocated)",
            held.reserved_peak - held.allocated_peak,
            res_peak - alloc_peak,
            f"{gib_figure(steady.inactive_split_end)} GiB in inactive split blocks at step end",
        )
    )
    return rows


def _nvml(est: Estimate, steady: StepRecord, acc: Account | None) -> tuple[Row, str | None]:
    """NVML's within-step peak, predicted (reserved + outside torch + managed) beside measured,
    and a difference beyond :data:`NVML_OFF` named by what the estimate does not model."""
    held = _modelled(est, first=False)
    predicted = (
        est.peak + est.optimizer_state_managed
        if held is None
        else held.reserved_peak + est.outside_torch + est.optimizer_state_managed
    )
    measured = steady.nvml_peak_bytes or 0
    row = Row(
        f"NVML used, step {steady.step}'s within-step peak",
        predicted,
        measured,
        "what nvidia-smi shows: everything above"
        if held is None
        else "predicted: reserved + outside torch + managed",
    )
    off = measured - predicted
    if held is None or abs(off) <= NVML_OFF * predicted:
        return row, None
    why = []
    res = steady.torch_reserved_peak_bytes
    if res is not None and abs(res - held.reserved_peak) > NVML_OFF / 2 * predicted:
        d = res - held.reserved_peak
        why.append(
            f"torch reserved {gib_figure(d)} GiB "
            + (
                "more than modelled: a second stream's pool, kernels' own workspaces (cuDNN) "
                "or a different batch or allocator setting"
                if d > 0
                else "less than modelled: the run is not the step estimated, or freed its cache"
            )
        )
    if acc is not None:
        outside = acc.baseline + (acc.outside or 0)
        if abs(outside - est.outside_torch) > 64 << 20:
            why.append(
                f"this process outside torch {gib_figure(outside)} GiB measured, "
                f"{gib_figure(est.outside_torch)} assumed ({est.outside_source}): NCCL's "
                "buffers, another driver or torch — `stepmem devices --calibrate` measures it"
            )
        if acc.other_processes:
            why.append(f"other processes held {gib_figure(acc.other_processes)} GiB")
        managed = acc.no_process or 0
        if abs(managed - est.optimizer_state_managed) > 64 << 20:
            why.append(
                f"managed memory {gib_figure(managed)} GiB measured, "
                f"{gib_figure(est.optimizer_state_managed)} predicted"
            )
    return row, (
        f"NVML's peak is {gib_figure(abs(off))} GiB {'above' if off > 0 else 'below'} the "
        f"prediction ({off / predicted:+.1%}): "
        + ("; ".join(why) if why else "not from torch's pool or this process's own memory")
        + "."
    )


def _outside(est: Estimate, acc: Account, step: int) -> list[Row]:
    """This process outside torch (predicted: the calibrated figure; 0 in estimates made before
    it), managed memory and other processes, by the accounting."""
    rows = [
        Row(
            "this process outside torch (CUDA context, cuBLAS, NCCL)",
            est.outside_torch,
            acc.baseline + (acc.outside or 0),
            f"at step {step}'s end; of it {gib_figure(acc.first_use)} GiB appeared on first "
            "use (workspaces, communicator buffers)",
        )
    ]
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
    return rows


def _what(est: Estimate) -> str:
    spec = est.spec
    if est.script:
        return f"{est.subject}, {spec.get('optim')}"
    return (
        f"{est.subject}, {spec.get('optim')}, batch {spec.get('batch')} × {spec.get('seq_len')} "
        "tokens"
    )


def _mismatches(rows: list[Row]) -> list[str]:
    """The stored figures (parameters, state, kept gradients) that differ beyond
    :data:`OFF_SHARE`: a sign the run is not the model or optimizer estimated."""
    out = []
    for row in rows[:3] + [r for r in rows if r.component.startswith("gradients (kept")]:
        d = row.difference
        if d is not None and row.predicted and abs(d) > OFF_SHARE * row.predicted:
            out.append(
                f"{row.component}: predicted {gib_figure(row.predicted)} GiB, measured "
                f"{gib_figure(row.measured or 0)} GiB ({d / row.predicted:+.1%}): the run's "
                "model or optimizer is not the one estimated?"
            )
    return out


class Reconciliation(NamedTuple):
    """Predicted against measured: the table's rows, the differences named, and — when the
    run's stored figures say it is another model or optimizer than the one estimated — that,
    in one line the table is read after ("": the same training)."""

    rows: list[Row]
    named: list[str]
    mismatch: str = ""


def reconcile(est: Estimate, records: Sequence[StepRecord]) -> Reconciliation:
    """Predicted against measured for one process's records on one GPU: rows of the table and
    the differences named with the measurement that explains them."""
    recs = [r for r in records if not r.failed and r.has_torch]
    if not recs:
        return Reconciliation([], ["no measured step with allocator figures: nothing to reconcile"])
    first, steady = recs[0], (recs[1] if len(recs) > 1 else recs[0])
    rows = _stored(est, first, steady)
    named: list[str] = []
    other = _mismatches(rows)
    mismatch = (  # another model or optimizer: said first, and no kernel blamed for it
        f"This estimate is of {_what(est)}; the run's parameters or optimizer state do "
        "not match it, so the differences below are between two different trainings"
        if other
        else ""
    )
    rest, off = _rest(est, steady)
    rows += [rest] if rest is not None else []
    named += [off] if off and not other else []
    jump = _jump(est, first, steady)
    named += [jump] if jump else []
    rows += _cache(est, first, steady)
    if steady.managed or est.optimizer_state_managed:
        named.append(
            f"Managed (paged) optimizer state: {gib_figure(steady.managed)} GiB measured, "
            f"{gib_figure(est.optimizer_state_managed)} GiB predicted — outside torch's pool: "
            "torch's figures never show it, NVML counts it once its pages sit on the GPU."
        )
    acc = next((a for a in accounts(recs) if a.step == steady.step), None)
    rows += _outside(est, acc, steady.step) if acc is not None else []
    if steady.nvml_peak_bytes is not None:
        nvml, why = _nvml(est, steady, acc)
        rows.append(nvml)
        named += [why] if why and not other else []
    return Reconciliation(rows, named + other, mismatch)


def _ratio(d: int | None, predicted: int | None) -> str:
    """The difference as a share of the prediction (``+4.2%``), or past ten times it as the
    ratio measured to predicted (``18×``)."""
    if d is None or not predicted:
        return ""
    share = d / predicted
    return f"{share:+.1%}" if abs(share) < 10 else f"{1 + share:.0f}×"


def render_reconciliation(est: Estimate, held: Reconciliation) -> str:
    rows, named = held.rows, held.named
    lines = [
        f"Predicted vs measured (GiB; estimate of {est.subject}, {est.spec.get('optim')})",
        *([f" ⚠ {held.mismatch}."] if held.mismatch else []),
        f"  {'component':<58}{'predicted':>10}{'measured':>10}{'diff':>9}{'':>9}",
    ]
    for r in rows:
        p = "—" if r.predicted is None else gib_figure(r.predicted)
        m = "—" if r.measured is None else gib_figure(r.measured)
        d = r.difference
        pct = _ratio(d, r.predicted)
        lines.append(
            f"  {r.component:<58}{p:>10}{m:>10}{'' if d is None else f'{d / GIB:+.2f}':>9}{pct:>9}"
        )
        if r.explains:
            lines.append(f"  {'':<4}{r.explains}")
    lines.extend(f" • {n}" for n in named)
    return "\n".join(lines)

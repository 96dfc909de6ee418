"""The process ``stepmem estimate --script`` runs a user's script in, unchanged, on fake tensors.

``python -m collector.estimate.script.child REQUEST.json`` reads what to run (the script, its
arguments, the allocator's settings, the GPU to hold it against) and writes the result where the
request says: the estimate of the steps traced, and the error that stopped the script early, if
one did. The script runs as ``python SCRIPT ARGS`` would run it (``__main__``, its folder first
on ``sys.path``, ``sys.argv`` its own) under:

* torch's fake tensors (no device memory; values read from a tensor — ``loss.item()``,
  ``bool(t)`` — are answered with placeholders, and the first line that read one is noted);
* one :class:`~torch.distributed._tools.mem_tracker.MemTracker` and one allocation log for the
  whole script, cut into steps by its probe marks (:mod:`.steps`);
* ``torch.cuda``'s memory queries answered from the estimate (:mod:`.counters`) — and, without
  a GPU, CUDA stood in for by the CPU, with CUDA's autocast, attention and dropout rules
  (:mod:`.cuda_api`), and the rest of ``torch.cuda`` by stand-ins (:mod:`.stand_ins`).

The script's output goes to the estimate's standard error; the estimate is the parent's to print.
"""

from __future__ import annotations

import contextlib
import json
import runpy
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import collector.estimate.build as build
import collector.estimate.cuda_rules as cuda_rules
import collector.estimate.script.host as host
from collector.estimate.alloc_log import AllocationLog
from collector.estimate.allocator_config import AllocatorConfig
from collector.estimate.fakes import (
    PLACEHOLDERS,
    Reads,
    conversions_in_place,
    cuda_optimizer_defaults,
    data_follows_device,
    fake_deepcopy,
    fake_mode,
    parameter_subclasses,
    pools_inline,
    values_formatted,
)
from collector.estimate.fit import Target
from collector.estimate.gpus import Card
from collector.estimate.lora import import_bitsandbytes
from collector.estimate.request import EstimateRequest
from collector.estimate.script.counters import LiveAllocator, counters_answered
from collector.estimate.script.cuda_api import cuda_on_cpu
from collector.estimate.script.paged import paged_state
from collector.estimate.script.said import describe, warnings_at
from collector.estimate.script.stand_ins import Graphs, raw_allocations
from collector.estimate.script.steps import ScriptSteps
from collector.estimate.script.weights import headers_only
from collector.estimate.tracing import (
    attention_note,
    hold_steps,
    holder_of,
    index_peaks,
    quiet,
    step_counters,
)
from collector.estimate.tracker import exact_bytes, tracker
from collector.model import marks
from collector.model.files import atomic_write
from collector.model.kinds import MemoryKind, Phase
from collector.model.prediction import Estimate
from collector.model.quantised import parameter_counts

__all__ = ["main", "trace_script"]


class _Roots:
    """The modules whose forward ran outside any other's: the models (when the script does not
    hand its model to the probe)."""

    def __init__(self) -> None:
        import torch

        self.found: list[Any] = []
        self.depth = 0
        hooks = torch.nn.modules.module
        self.handles = [
            hooks.register_module_forward_pre_hook(self._pre),
            hooks.register_module_forward_hook(self._post),
        ]

    def _pre(self, module: Any, args: Any) -> None:
        if self.depth == 0 and all(m is not module for m in self.found):
            self.found.append(module)
        self.depth += 1

    def _post(self, module: Any, args: Any, out: Any) -> None:
        self.depth = max(0, self.depth - 1)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def _as_main(script: Path, args: list[str]) -> Iterator[None]:
    """``sys.argv`` and ``sys.path`` as ``python SCRIPT ARGS`` sets them."""
    argv, path = sys.argv[:], sys.path[:]
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.parent))
    try:
        yield
    finally:
        sys.argv, sys.path[:] = argv, path


def _where_now(tracker: Any) -> Any:
    def now() -> str:
        parents = getattr(getattr(tracker, "_mod_tracker", None), "parents", None) or ()
        names = [n for n in parents if n != "Global"]
        return max(names, key=lambda n: (n.count("."), len(n))) if names else ""

    return now


class _Run:
    """One script's trace: its parts, and what came of running it."""

    def __init__(
        self,
        script: Path,
        cuda: bool,
        device: Any,
        allocator: AllocatorConfig,
        real: bool,
        other: bool = False,
    ) -> None:
        self.script, self.cuda, self.device, self.real = script, cuda, device, real
        self.tracker = tracker()
        index_peaks(self.tracker)
        self.log = AllocationLog(device, where_now=_where_now(self.tracker))
        self.live = LiveAllocator(self.log, allocator)
        self.steps = ScriptSteps(self.tracker, self.log, device, live=self.live)
        choose = cuda_rules.dispatcher_choice(device) if cuda else cuda_rules.rules_choice
        self.attention = cuda_rules.CudaAttention(None, choose)
        self.reads = Reads(script, self.log, other)
        self.error = ""
        self.ended = False  # the script ran to its end (or exit) before the steps were traced

    def on_autocast(self, dtype: Any, stack: contextlib.ExitStack) -> None:
        """The script's first CUDA autocast: its dtype for the attention's inputs; on the CPU
        stand-in, CUDA's cast lists installed for it (not on real tensors: CUDA's kernels are
        not the CPU's)."""
        self.attention.autocast_dtype = dtype
        if not self.cuda and not self.real:
            stack.enter_context(cuda_rules.cuda_autocast(dtype))

    def run(self, args: list[str], card: Any) -> None:
        import torch

        with contextlib.ExitStack() as st:
            st.enter_context(quiet())
            st.enter_context(exact_bytes())
            if not self.real:  # CUDA's kernels, on fake tensors
                st.enter_context(self.attention)
                if not self.cuda:
                    st.enter_context(cuda_rules.cuda_dropout())
            st.enter_context(
                cuda_on_cpu(
                    card.name,
                    card.capacity,
                    lambda d: self.on_autocast(d, st),
                    self.cuda,
                    lambda: self.reads.answer(torch.float32),
                    fakes=not self.real,
                )
            )
            st.enter_context(cuda_optimizer_defaults(stand_in=not self.cuda))
            st.enter_context(host.workers_plain())  # the dataset in its workers: real tensors
            if not self.cuda:
                st.enter_context(host.pinning_on_stand_in())
            if not self.real:
                self._fakes(st)
            st.enter_context(self.log.resizes())
            st.enter_context(self.log.streams_followed(self.cuda))
            st.enter_context(self.log.mode())
            st.enter_context(self.tracker)
            if not self.real:  # on real CPU tensors bitsandbytes keeps paged state on the device
                st.enter_context(paged_state(self.tracker, self.log))
            st.enter_context(counters_answered(self.live, card.capacity, card.outside_torch))
            st.enter_context(raw_allocations(self.device))
            roots = _Roots()
            self.steps.roots = roots.found
            st.callback(roots.close)
            st.callback(marks.listen, None)
            marks.listen(self.steps)
            self.log.mark(Phase.BUILD)
            self._run_script(args)
            self.reads.close()  # the trace's allocations, all in its last digest
            if not self.steps.models:
                self.steps.models = roots.found[:1]
            self._drop_step_counters()

    def _fakes(self, st: contextlib.ExitStack) -> None:
        """Fake tensors and what a script needs of them (:mod:`.fakes`), weights as shapes."""
        st.enter_context(fake_mode(self.reads, host=host))
        st.enter_context(values_formatted())
        st.enter_context(conversions_in_place())
        st.enter_context(data_follows_device())
        st.enter_context(fake_deepcopy())
        st.enter_context(parameter_subclasses())
        st.enter_context(headers_only())
        st.enter_context(pools_inline())
        # transformers asks whether the batch packs several sequences (reading positions a fake
        # tensor does not have): answered as for one sequence a row, which keeps the causal
        # attention maskless (flash, grouped heads) as it is on real tensors
        st.enter_context(build.unpacked_inputs())

    def _run_script(self, args: list[str]) -> None:
        try:
            with _as_main(self.script, args), warnings_at(self.script):
                runpy.run_path(str(self.script), run_name="__main__")
            self.ended = True
        except marks.TraceDone:
            pass
        except SystemExit as exc:
            self.ended = True
            if exc.code not in (None, 0):
                self.error = f"{self.script.name}: the script exited with status {exc.code}"
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self.error = describe(exc, self.script)

    def _drop_step_counters(self) -> None:
        """The optimizers' step counters: CUDA keeps them on the host, the stand-in (on real
        tensors) on its device; they are not the GPU's bytes."""
        if self.cuda:
            return
        counters = [c for opt in list(self.steps.optimizers) for c in step_counters(opt)]
        counters = [c for c in counters if c.device == self.device]  # (else the host's already)
        self.log.drop({k for k in map(self.log.key_of, counters) if k is not None})
        n = sum(c.numel() * c.element_size() for c in counters)
        for d in (*self.steps.per_step, self.steps.at_end):
            if n and d.get(MemoryKind.OPTIMIZER_STATE, 0) >= n:
                d[MemoryKind.OPTIMIZER_STATE] -= n


def _before_the_stand_in() -> None:
    """Libraries that pick a CUDA backend when they are imported with CUDA there: imported
    before the stand-in says it is (bitsandbytes then runs its CPU ops, whose fake kernels the
    trace uses; its CUDA ones cannot load without CUDA)."""
    import_bitsandbytes()


def _optimizers_seen(steps: ScriptSteps) -> Any:
    """Every optimizer that steps, handed to ``steps`` (the script may not give the probe one)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    return register_optimizer_step_post_hook(lambda opt, a, k: steps.add_optimizer(opt))


def trace_script(
    script: Path,
    args: list[str],
    allocator: AllocatorConfig,
    target: Target | None,
    card: Card,
    real: bool = False,
    other: bool = False,
) -> tuple[Estimate | None, str, Reads]:
    """Run ``script`` with ``args`` under the estimate; its estimate (None: no step traced),
    the error that stopped it early ("" when none did) and the values it read. ``real``: the
    same steps traced on real tensors (the tests hold the fake trace to it): without the fake
    mode and CUDA's kernels' rules; without a GPU, CUDA still stood in for by the CPU.
    ``other``: values read answered with the second set of placeholders."""
    build.offline()
    import torch

    if not torch.cuda.is_available():
        _before_the_stand_in()
    t0 = time.monotonic()
    cuda = torch.cuda.is_available()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if cuda
        else torch.device("cpu")
        if real  # real CPU tensors: the host's device is the stand-in's too
        else host.stand_in()
    )
    run = _Run(script, cuda, device, allocator, real, other)
    hook = _optimizers_seen(run.steps)
    try:
        run.run(args, card)
    finally:
        hook.remove()
    if not run.steps.steps:
        why = run.error or (
            f"{script.name} ran to its end without a probe step: add the probe's lines (README, "
            "'Estimate your own script') or its Hugging Face or Lightning callback"
            if run.ended
            else f"{script.name}: stopped before its first probe step ended"
        )
        return None, why, run.reads
    out = _result(run, args, time.monotonic() - t0)
    hold_steps(out, run.log, allocator, _held_against(target, run.live.fraction))
    return out, run.error, run.reads


def _held_against(target: Target | None, fraction: float | None) -> Target | None:
    """``target`` with the share the script gave ``set_per_process_memory_fraction`` (the lower
    of it and ``--memory-fraction`` when both are given), as torch would apply it."""
    if target is None or fraction is None or fraction <= 0:
        return target
    return replace(target, fraction=min(fraction, target.fraction or 1.0))


def _result(run: _Run, args: list[str], seconds: float) -> Estimate:
    import torch

    s = run.steps
    models = s.models
    params = {id(p): p for m in models for p in m.parameters()}
    resident = [MemoryKind.PARAMETERS, MemoryKind.BUFFERS, MemoryKind.OPTIMIZER_STATE]
    if s.at_end.get(MemoryKind.GRADIENTS, 0):
        resident.append(MemoryKind.GRADIENTS)  # gradients kept between steps
    steady = s.per_step[-1]
    holder = None if s.in_optimizer else holder_of(s.modules, sum(steady.values()))
    notes = _notes(run, len(s.per_step))
    managed = sum(int(getattr(o, "stepmem_managed", 0)) for o in list(s.optimizers))
    counts = parameter_counts(params.values())
    return Estimate(
        spec={
            "workload": "script",
            "script": run.script.name,
            "args": [str(a)[:200] for a in args[:40]],
            "optim": ", ".join(sorted({type(o).__name__ for o in list(s.optimizers)})) or "none",
            "steps": s.numbers[: len(s.per_step)],
            "model": ", ".join(dict.fromkeys(type(m).__name__ for m in models))[:200],
        },
        device=str(run.device) if run.cuda else "cpu",  # (the stand-in's cpu:0)
        stand_in=not run.cuda,
        parameters_count=counts[0],
        trainable_count=counts[1],
        steady=steady,
        first=s.per_step[0],
        at_end={k: s.at_end.get(k, 0) for k in resident},
        optimizer_state_managed=managed,
        peak_module=holder.module if holder else "",
        peak_phase=holder.phase if holder else (Phase.OPTIMIZER if s.in_optimizer else ""),
        modules=s.modules,
        notes=notes,
        stopped_at=run.error.split(": ", 1)[0] if run.error else "",
        seconds=round(seconds, 2),
        torch=torch.__version__,
        device_allocated=int(torch.cuda.max_memory_allocated(run.device)) if run.cuda else None,
    )


def _notes(run: _Run, traced: int) -> list[str]:
    notes = [f"{run.script.name} run on fake tensors through its first {traced} probe step(s)"]
    if not run.cuda:
        notes.append(
            "no GPU here: fake tensors on the CPU stand in for CUDA, with CUDA's autocast cast "
            "lists, dropout and the attention kernel CUDA's dispatcher picks"
        )
    if run.reads.count:
        notes.append(
            f"{run.reads.count} value(s) read from tensors (.item(), bool(), a print of a value) "
            f"answered with placeholders ({PLACEHOLDERS['float']}, {PLACEHOLDERS['int']}, "
            f"{PLACEHOLDERS['bool']}), the first at {run.reads.first or '?'}: a branch on them "
            "takes the placeholder's way"
        )
    if traced == 1:
        notes.append(
            "one step traced: optimizer state made in its optimizer step is not held through a "
            "second step's forward and backward here"
        )
    if run.live.fraction is not None:
        notes.append(
            f"the script calls set_per_process_memory_fraction({run.live.fraction:g}): the step "
            "is held against that share of the card"
        )
    if not run.cuda and Graphs.captured:
        notes.append(
            f"{Graphs.captured} CUDA graph capture(s): the captured code traced once, as the "
            "capture runs it; a replay allocates nothing more (the graph's private pool is not "
            "modelled apart from the caching allocator's)"
        )
    if run.error:
        notes.append(f"stopped early: {run.error}")
    return notes + attention_note(run.attention.chosen)


def main(argv: list[str] | None = None) -> int:
    """Run the request in ``argv[0]`` (written by the parent: a planned
    :class:`~collector.estimate.request.EstimateRequest` and where the result goes)."""
    argv = sys.argv[1:] if argv is None else argv
    doc = json.loads(Path(argv[0]).read_text())
    req = EstimateRequest.from_dict(doc["request"])
    assert req.script is not None
    sys.stdout = sys.stderr  # the script's prints are not the estimate
    est, error, reads = trace_script(
        req.script.path,
        list(req.script.args),
        req.allocator,
        req.target,
        req.counters_card,
        req.real,
        bool(doc.get("other_placeholders")),
    )
    result = {
        "estimate": est.to_dict() if est else None,
        "error": error,
        "reads": {"answered": reads.answered, "trail": reads.trail, "end": reads.digest()},
    }
    atomic_write(Path(doc["result"]), json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

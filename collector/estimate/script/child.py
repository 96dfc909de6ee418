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
* ``torch.cuda``'s memory counters answered from the estimate (:mod:`.cuda_api`) — and, without
  a GPU, CUDA stood in for by the CPU, with CUDA's autocast, attention and dropout rules.

The script's output goes to the estimate's standard error; the estimate is the parent's to print.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import collector.estimate.build as build
import collector.estimate.cuda_rules as cuda_rules
from collector.estimate.allocator_config import AllocatorConfig
from collector.estimate.fit import Target
from collector.estimate.script.cuda_api import LiveAllocator, counters_answered, cuda_on_cpu
from collector.estimate.script.steps import ScriptSteps
from collector.estimate.script.weights import headers_only
from collector.estimate.sequence import AllocationLog
from collector.estimate.trace import (
    attention_note,
    hold_steps,
    holder_of,
    index_peaks,
    quiet,
    step_counters,
)
from collector.estimate.tracker import tracker
from collector.model import marks
from collector.model.kinds import MemoryKind
from collector.model.prediction import Estimate

__all__ = ["main", "trace_script"]

PLACEHOLDERS = {"float": 1.0, "int": 1, "bool": False}  # what a read of a fake value answers
_FAKE_ERRORS = (
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "UnsupportedOperatorException",
    "UnsupportedFakeTensorException",
    "GuardOnDataDependentSymNode",
)


class _Reads:
    """Where the script read a tensor's value (the first place, and how many reads)."""

    def __init__(self, script: Path) -> None:
        self.script, self.count, self.first = script, 0, ""

    def note(self) -> None:
        """A read; one torch or bitsandbytes makes itself (an optimizer reading its step count,
        a quantisation map built) is not noted: those are host values, or do not change what is
        allocated."""
        frames = [f for f in traceback.extract_stack()[:-2] if not _machinery(f.filename)]
        if frames and any(d in frames[-1].filename for d in ("/torch/", "/bitsandbytes/")):
            return
        self.count += 1
        if not self.first:
            self.first = _place(frames, self.script)


_MACHINERY = (
    "/collector/",
    "/torch/_subclasses/",
    "/torch/utils/_python_dispatch",
    "/torch/distributed/_tools/",
    "/torch/_ops.py",
    "/torch/overrides.py",
    "/torch/_tensor.py",
    "/torch/_tensor_str.py",
    "/torch/_compile.py",
    "/torch/_dynamo/",
)


def _machinery(filename: str) -> bool:
    """A frame of the fake mode, the trackers or a tensor's own formatting, not of a reader."""
    return any(m in filename for m in _MACHINERY)


def _place(frames: Any, script: Path) -> str:
    """``file:line`` of the innermost frame in ``script``, else of the innermost frame outside
    torch and stepmem."""
    mine = [f for f in frames if _same(f.filename, script)]
    if not mine:
        mine = [
            f for f in frames if "/torch/" not in f.filename and "/collector/" not in f.filename
        ]
    if not mine:
        return ""
    f = mine[-1]
    return f"{Path(f.filename).name}:{f.lineno}"


def _same(filename: str, script: Path) -> bool:
    try:
        return Path(filename).resolve() == script
    except OSError:
        return False


def _fake_mode(reads: _Reads) -> Any:
    """Torch's fake mode, answering a read of a value with a placeholder (:data:`PLACEHOLDERS`)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    scalar = torch.ops.aten._local_scalar_dense.default

    class ScriptFakeMode(FakeTensorMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is scalar:
                reads.note()
                dtype = args[0].dtype
                if dtype == torch.bool:
                    return PLACEHOLDERS["bool"]
                return PLACEHOLDERS["float" if dtype.is_floating_point else "int"]
            return super().__torch_dispatch__(func, types, args, kwargs)

    return ScriptFakeMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def _conversions_in_place() -> Iterator[None]:
    """``module.to(…)``, ``.cuda()``, ``.half()`` as they run on real tensors: each parameter's
    new tensor set as its ``.data``. (On fake tensors torch swaps the parameter objects instead,
    which fails for any tensor something holds a weak reference to — the tracker does.)"""
    import torch

    real = torch.nn.Module._apply

    def _apply(self: Any, fn: Any, recurse: bool = True) -> Any:
        if recurse:
            for module in self.children():
                module._apply(fn)
        for key, param in self._parameters.items():
            if param is None:
                continue
            with torch.no_grad():
                applied = fn(param)
                grad = param.grad
                grad_applied = fn(grad) if grad is not None else None
            if applied is not param:
                if torch._has_compatible_shallow_copy_type(param, applied):
                    param.data = applied
                else:
                    self._parameters[key] = torch.nn.Parameter(applied, param.requires_grad)
            if grad is not None and grad_applied is not grad:
                self._parameters[key].grad = grad_applied
        for key, buf in self._buffers.items():
            if buf is not None:
                self._buffers[key] = fn(buf)
        return self

    torch.nn.Module._apply = _apply
    try:
        yield
    finally:
        torch.nn.Module._apply = real


@contextlib.contextmanager
def _fake_deepcopy() -> Iterator[None]:
    """``copy.deepcopy`` of a fake tensor (a logged value, an EMA model's buffers) as a clone:
    torch's copies the storage, which a fake tensor does not have on its device."""
    from torch._subclasses.fake_tensor import FakeTensor

    def deepcopy(self: Any, memo: dict[int, Any]) -> Any:
        if id(self) not in memo:
            out = self.detach().clone()
            if self.requires_grad:
                out.requires_grad_(True)
            memo[id(self)] = out
        return memo[id(self)]

    real = FakeTensor.__dict__.get("__deepcopy__")
    FakeTensor.__deepcopy__ = deepcopy
    try:
        yield
    finally:
        if real is None:
            del FakeTensor.__deepcopy__
        else:
            FakeTensor.__deepcopy__ = real


@contextlib.contextmanager
def _parameter_subclasses() -> Iterator[None]:
    """A parameter subclass made of a fake tensor (bitsandbytes' ``Params4bit`` and
    ``Int8Params``) made as a fake tensor of that class too: the class's own methods run (its
    ``.to()`` quantises through bitsandbytes' fake kernels, so the packed weight and its
    quantisation state are laid out by bitsandbytes itself) and the fake mode runs its
    operators. Torch's ``_make_subclass`` refuses a tensor that is already a fake tensor."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    real = torch.Tensor._make_subclass
    mixed: dict[type, type] = {}

    def make_subclass(cls: type, data: Any, requires_grad: bool = False, *a: Any, **k: Any) -> Any:
        if (
            isinstance(data, FakeTensor)
            and issubclass(cls, torch.nn.Parameter)
            and cls is not torch.nn.Parameter
            and not issubclass(cls, FakeTensor)
        ):
            if cls not in mixed:
                mixed[cls] = type(cls.__name__, (FakeTensor, cls), {"__module__": cls.__module__})
            out = data.detach()
            out.requires_grad_(requires_grad)
            out.__class__ = mixed[cls]
            return out
        return real(cls, data, requires_grad, *a, **k)

    torch.Tensor._make_subclass = staticmethod(make_subclass)
    try:
        yield
    finally:
        torch.Tensor._make_subclass = real


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


def describe(exc: BaseException, script: Path) -> str:
    """The error that stopped the script, named at the script's own line."""
    frames = traceback.extract_tb(exc.__traceback__)
    at = _place(frames, script) or script.name
    inner = frames[-1] if frames else None
    where = f" (in {Path(inner.filename).name}:{inner.lineno})" if inner else ""
    text = " ".join(str(exc).split())[:240]
    name = type(exc).__name__
    fake = name in _FAKE_ERRORS or any(
        s in text for s in ("FakeTensor", "fake tensor", "data pointer", "Meta", "meta tensor")
    )
    what = "cannot run on fake tensors" if fake else "the script raised"
    return f"{at}: {what}: {name}: {text}{where}"


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

    def __init__(self, script: Path, cuda: bool, device: Any, allocator: AllocatorConfig) -> None:
        self.script, self.cuda, self.device = script, cuda, device
        self.tracker = tracker()
        index_peaks(self.tracker)
        self.log = AllocationLog(device, where_now=_where_now(self.tracker))
        self.live = LiveAllocator(self.log, allocator)
        self.steps = ScriptSteps(self.tracker, self.log, device, live=self.live)
        choose = cuda_rules.dispatcher_choice(device) if cuda else cuda_rules.rules_choice
        self.attention = cuda_rules.CudaAttention(None, choose)
        self.reads = _Reads(script)
        self.error = ""
        self.ended = False  # the script ran to its end (or exit) before the steps were traced

    def on_autocast(self, dtype: Any, stack: contextlib.ExitStack) -> None:
        """The script's first CUDA autocast: its dtype for the attention's inputs; on the CPU
        stand-in, CUDA's cast lists installed for it."""
        self.attention.autocast_dtype = dtype
        if not self.cuda:
            stack.enter_context(cuda_rules.cuda_autocast(dtype))

    def run(self, args: list[str], card: Any) -> None:
        with contextlib.ExitStack() as st:
            st.enter_context(quiet())
            st.enter_context(self.attention)
            if not self.cuda:
                st.enter_context(cuda_rules.cuda_dropout())
            st.enter_context(
                cuda_on_cpu(card.name, card.capacity, lambda d: self.on_autocast(d, st), self.cuda)
            )
            st.enter_context(_fake_mode(self.reads))
            st.enter_context(_conversions_in_place())
            st.enter_context(_fake_deepcopy())
            st.enter_context(_parameter_subclasses())
            st.enter_context(headers_only())
            st.enter_context(self.log.resizes())
            st.enter_context(self.log.streams_followed(self.cuda))
            st.enter_context(self.log.mode())
            st.enter_context(self.tracker)
            st.enter_context(counters_answered(self.live, card.capacity, card.outside_torch))
            roots = _Roots()
            self.steps.roots = roots.found
            st.callback(roots.close)
            st.callback(marks.listen, None)
            marks.listen(self.steps)
            self.log.mark("build")
            self._run_script(args)
            if not self.steps.models:
                self.steps.models = roots.found[:1]
            self._drop_step_counters()

    def _run_script(self, args: list[str]) -> None:
        try:
            with _as_main(self.script, args):
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
        """The optimizers' step counters: CUDA keeps them on the host, the stand-in on its
        device; they are not the GPU's bytes."""
        if self.cuda:
            return
        counters = [c for opt in list(self.steps.optimizers) for c in step_counters(opt)]
        keys = {k for k in map(self.log.key_of, counters) if k is not None}
        self.log.drop(keys)
        n = sum(c.numel() * c.element_size() for c in counters)
        for d in (*self.steps.per_step, self.steps.at_end):
            if n and d.get(MemoryKind.OPTIMIZER_STATE, 0) >= n:
                d[MemoryKind.OPTIMIZER_STATE] -= n


def _before_the_stand_in() -> None:
    """Libraries that pick a CUDA backend when they are imported with CUDA there: imported
    before the stand-in says it is (bitsandbytes then runs its CPU ops, whose fake kernels the
    trace uses; its CUDA ones cannot load without CUDA)."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is not None:
        import bitsandbytes  # noqa: F401


def _optimizers_seen(steps: ScriptSteps) -> Any:
    """Every optimizer that steps, handed to ``steps`` (the script may not give the probe one)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    return register_optimizer_step_post_hook(lambda opt, a, k: steps.add_optimizer(opt))


def trace_script(
    script: Path, args: list[str], allocator: AllocatorConfig, target: Target | None, card: Any
) -> tuple[Estimate | None, str]:
    """Run ``script`` with ``args`` under the estimate; its estimate (None: no step traced)
    and the error that stopped it early ("" when none did)."""
    build.offline()
    import torch

    if not torch.cuda.is_available():
        _before_the_stand_in()
    t0 = time.monotonic()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    run = _Run(script, cuda, device, allocator)
    hook = _optimizers_seen(run.steps)
    try:
        run.run(args, card)
    finally:
        hook.remove()
    if not run.steps.steps:
        return None, run.error or (
            f"{script.name} ran to its end without a probe step: add the probe's lines (README, "
            "'Estimate your own script') or its Hugging Face or Lightning callback"
            if run.ended
            else f"{script.name}: stopped before its first probe step ended"
        )
    out = _result(run, args, time.monotonic() - t0)
    hold_steps(out, run.log, allocator, target)
    return out, run.error


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
    return Estimate(
        spec={
            "workload": "script",
            "script": run.script.name,
            "args": [str(a)[:200] for a in args[:40]],
            "optim": ", ".join(sorted({type(o).__name__ for o in list(s.optimizers)})) or "none",
            "steps": s.numbers[: len(s.per_step)],
        },
        device=str(run.device),
        stand_in=not run.cuda,
        parameters_count=int(sum(p.numel() for p in params.values())),
        steady=steady,
        first=s.per_step[0],
        at_end={k: s.at_end.get(k, 0) for k in resident},
        optimizer_state_managed=managed,
        peak_module=holder.module if holder else "",
        peak_phase=holder.phase if holder else ("optimizer step" if s.in_optimizer else ""),
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
    if run.error:
        notes.append(f"stopped early: {run.error}")
    return notes + attention_note(run.attention.chosen)


def main(argv: list[str] | None = None) -> int:
    from collector.estimate import gpus

    argv = sys.argv[1:] if argv is None else argv
    req = json.loads(Path(argv[0]).read_text())
    allocator = (
        AllocatorConfig.parse(req["alloc_conf"], "--alloc-conf")
        if req.get("alloc_conf")
        else AllocatorConfig.from_env()
    )
    target = None
    card = gpus.card(req["gpu"]) if req.get("gpu") else None
    if card is None:
        import torch

        card = gpus.local_card() if torch.cuda.is_available() else gpus.card("H200")
        if torch.cuda.is_available():
            target = Target(card, req.get("margin", 0.0), req.get("fraction"))
    else:
        target = Target(card, req.get("margin", 0.0), req.get("fraction"))
    sys.stdout = sys.stderr  # the script's prints are not the estimate
    est, error = trace_script(Path(req["script"]), list(req["args"]), allocator, target, card)
    result = {"estimate": est.to_dict() if est else None, "error": error}
    tmp = Path(req["result"] + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, req["result"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

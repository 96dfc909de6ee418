"""Fake tensors as a user's script needs them (:mod:`.child` runs the script under them).

* values read from a fake tensor (``loss.item()``, ``bool(t)``) are answered as a healthy run
  answers them where that needs no data (:class:`Healthy`: a NaN check is false, a flag made
  zero and only checked for infinities — ``GradScaler``'s ``found_inf`` — is zero), else with
  placeholders (:data:`PLACEHOLDERS`, or another set for the second trace that shows whether a
  placeholder decided what is allocated); every read's place is kept (:class:`Reads`);
* ``module.to(…)`` converts parameters in place as on real tensors
  (:func:`conversions_in_place`), ``copy.deepcopy`` of a fake tensor clones it
  (:func:`fake_deepcopy`), and a parameter subclass (bitsandbytes' ``Params4bit``) made of a
  fake tensor is a fake tensor of its class (:func:`parameter_subclasses`).
"""

from __future__ import annotations

import contextlib
import hashlib
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from collector.estimate.swap import swapped

__all__ = [
    "PLACEHOLDERS",
    "Healthy",
    "Reads",
    "conversions_in_place",
    "cuda_optimizer_defaults",
    "data_follows_device",
    "fake_deepcopy",
    "fake_mode",
    "parameter_subclasses",
    "place",
    "pools_inline",
    "values_formatted",
]

PLACEHOLDERS = {"float": 1.0, "int": 1, "bool": False}  # what a read of a fake value answers
TRAIL_MAX = 5000  # reads whose place and allocations-so-far are kept (the first ones)


class Reads:
    """The values read from fake tensors: how many were answered with a placeholder, where the
    script first read one, and — for the comparison of two traces — each read's place and a
    digest of the allocations before it (``log``'s events). ``other``: answer with the second
    set of placeholders (each read its own integer and float, booleans true), which a trace
    that no placeholder decides does not notice."""

    def __init__(self, script: Path | None = None, log: Any = None, other: bool = False) -> None:
        self.script, self.count, self.first = script, 0, ""
        self.log, self.other = log, other
        self.answered = 0  # every placeholder answered, torch's own reads included
        self.trail: list[tuple[str, str]] = []
        self._digest, self._seen = hashlib.blake2b(digest_size=8), 0

    def answer(self, dtype: Any) -> Any:
        """A placeholder for a read of a value of ``dtype``, the read noted."""
        self.answered += 1
        self.note()
        floating = dtype.is_floating_point
        kind = "bool" if str(dtype) == "torch.bool" else "float" if floating else "int"
        if not self.other:
            return PLACEHOLDERS[kind]
        k = self.answered % 13
        return {"bool": True, "int": 2 + k, "float": 0.25 + k / 4}[kind]

    def digest(self) -> str:
        """A digest of every allocation and free the log holds so far (keys are the log's
        counters, the same in two traces that allocate alike)."""
        events = self.log.events if self.log is not None else []
        for kind, key, nbytes in events[self._seen :]:
            self._digest.update(f"{kind}{key}:{nbytes};".encode())
        self._seen = len(events)
        return self._digest.hexdigest()

    def close(self) -> None:
        """The trace is over: the digest keeps what the log held then."""
        self.digest()
        self.log = None

    def note(self) -> None:
        """A read; one torch or bitsandbytes makes itself (an optimizer reading its step count,
        a quantisation map built) is not counted as the script's (those are host values, or do
        not change what is allocated) but is kept on the trail."""
        frames = [f for f in traceback.extract_stack()[:-3] if not _machinery(f.filename)]
        where = place(frames, self.script) if self.script is not None else ""
        if len(self.trail) < TRAIL_MAX:
            self.trail.append((where, self.digest()))
        if frames and any(d in frames[-1].filename for d in ("/torch/", "/bitsandbytes/")):
            return
        self.count += 1
        if not self.first:
            self.first = where


# what a healthy run's values are (:class:`Healthy`), by aten operator name
_MADE = {"isnan": False, "isinf": False, "isposinf": False, "isneginf": False, "isfinite": True}
_FILLS = {"zeros": 0, "zeros_like": 0, "new_zeros": 0, "ones": 1, "ones_like": 1, "new_ones": 1}
_KEEPS = frozenset({
    "_to_copy", "clone", "detach", "alias", "view", "_unsafe_view", "reshape", "squeeze",
    "unsqueeze", "expand", "lift_fresh", "lift_fresh_copy", "t", "permute", "select", "slice",
    "contiguous", "any", "all",
})  # fmt: skip
_LOGIC = {"logical_or": any, "bitwise_or": any, "logical_and": all, "bitwise_and": all}
_CHECKS = frozenset({"_amp_foreach_non_finite_check_and_unscale_"})  # healthy: nothing found


class Healthy:
    """What a value read would be in a healthy run, where that needs no data: a NaN or infinity
    check is false (``isfinite`` true), a tensor filled with a value holds it (``GradScaler``'s
    ``found_inf``, made zero and written only by the check for infinities), and both survive
    copies, views, ``any``/``all`` and logic. Anything written in place is forgotten."""

    def __init__(self) -> None:
        from torch.utils.weak import WeakIdKeyDictionary

        self.of: Any = WeakIdKeyDictionary()
        self._writes: dict[Any, tuple[int, ...]] = {}

    def value(self, t: Any) -> Any:
        """The healthy value of ``t`` (None: not known)."""
        return self.of.get(t)

    def after(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """What ``func(*args, **kwargs)`` (which gave ``out``) makes known or forgets."""
        import torch

        name = func.overloadpacket.__name__
        if name not in _CHECKS:
            for i in self._written(func):
                for t in args[i] if isinstance(args[i], (list, tuple)) else [args[i]]:
                    if isinstance(t, torch.Tensor):
                        self.of.pop(t, None)
        if name in ("fill_", "zero_") and args:
            fill = 0 if name == "zero_" else args[1]
            if not isinstance(fill, torch.Tensor):
                self.of[args[0]] = fill
            return
        if not isinstance(out, torch.Tensor):
            return
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in _MADE:
            self.of[out] = _MADE[name]
        elif name in _FILLS:
            self.of[out] = _FILLS[name]
        elif name in ("full", "new_full", "full_like", "scalar_tensor"):
            fill = args[0] if name == "scalar_tensor" else args[1] if len(args) > 1 else None
            if isinstance(fill, (bool, int, float)):
                self.of[out] = fill
        elif name == "logical_not" and first is not None and self.value(first) is not None:
            self.of[out] = not self.value(first)
        elif name in _LOGIC and len(args) > 1:
            both = [self.value(a) if isinstance(a, torch.Tensor) else a for a in args[:2]]
            if all(v is not None for v in both):
                self.of[out] = _LOGIC[name](bool(v) for v in both)
        elif name in _KEEPS and first is not None and self.value(first) is not None:
            v = self.value(first)
            self.of[out] = bool(v) if name in ("any", "all") else v

    def _written(self, func: Any) -> tuple[int, ...]:
        """The positions of the arguments ``func`` writes in place."""
        if func not in self._writes:
            self._writes[func] = tuple(
                i
                for i, a in enumerate(func._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write and not a.kwarg_only
            )
        return self._writes[func]


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


def place(frames: Any, script: Path) -> str:
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


def fake_mode(reads: Reads, allow_real: bool = True, host: Any = None) -> Any:
    """Torch's fake mode, answering a read of a value as a healthy run would (:class:`Healthy`)
    where that needs no data, else with a placeholder (``reads``). ``host``: a script's host
    side (:mod:`collector.estimate.script.host`): ``host.real_op(func, args, kwargs)`` whether an
    operator runs for real instead, on real tensors."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    scalar = aten._local_scalar_dense.default
    healthy = Healthy()

    class ScriptFakeMode(FakeTensorMode):
        inside = 0  # calls of this mode's own dispatch under way (its rules call factories)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if host is not None and not self.inside and host.real_op(func, args, kwargs):
                return func(*args, **kwargs)  # (not a factory the fake mode's own rules call)
            if func is aten._to_copy.default and args[0].device.type == "meta":
                dev = kwargs.get("device")
                if dev is not None and torch.device(dev).type != "meta":  # weights, loaded
                    x = args[0]
                    made = {"dtype": kwargs.get("dtype") or x.dtype, "device": dev}
                    return super().__torch_dispatch__(
                        aten.empty_strided.default, types, (x.shape, x.stride()), made
                    )
            if func in (aten._pin_memory.default, aten.pin_memory.default):
                return args[0]  # pinned host memory: not the GPU's (a DataLoader's pin thread)
            if func is aten.is_pinned.default:
                return False
            if func is aten.copy_.default and args[1].device.type == "meta":
                return args[0]  # a weight copied in: the destination holds it already
            if func is scalar:
                known, dtype = healthy.value(args[0]), args[0].dtype
                if known is None:
                    return reads.answer(dtype)
                if dtype == torch.bool:
                    return bool(known)
                return float(known) if dtype.is_floating_point else int(known)
            self.inside += 1
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self.inside -= 1
            healthy.after(func, args, kwargs, out)
            return out

    return ScriptFakeMode(allow_non_fake_inputs=allow_real)


@contextlib.contextmanager
def conversions_in_place() -> Iterator[None]:
    """``module.to(…)``, ``.cuda()``, ``.half()`` as they run on real tensors: each parameter's
    new tensor set as its ``.data``. (On fake tensors torch swaps the parameter objects instead,
    which fails for any tensor something holds a weak reference to — the tracker does.)"""
    import torch

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

    with swapped(torch.nn.Module, _apply=_apply):
        yield


@contextlib.contextmanager
def values_formatted() -> Iterator[None]:
    """``f"{loss:.4f}"`` of a fake 0-dim tensor formats its value (a placeholder), as torch
    formats a real one's; torch formats only plain tensors so and raises for a fake."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    def format_(self: Any, spec: str) -> str:
        if self.dim() == 0:
            return self.item().__format__(spec)
        return torch.Tensor.__format__(self, spec)

    with swapped(FakeTensor, __format__=format_):
        yield


@contextlib.contextmanager
def fake_deepcopy() -> Iterator[None]:
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

    with swapped(FakeTensor, __deepcopy__=deepcopy):
        yield


@contextlib.contextmanager
def parameter_subclasses() -> Iterator[None]:
    """A parameter subclass made of a fake tensor (bitsandbytes' ``Params4bit`` and
    ``Int8Params``) made as a fake tensor of that class too: the class's own methods run (its
    ``.to()`` quantises through bitsandbytes' fake kernels, so the packed weight and its
    quantisation state are laid out by bitsandbytes itself) and the fake mode runs its
    operators. Torch's ``_make_subclass`` refuses a tensor that is already a fake tensor."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    real = torch.Tensor._make_subclass  # torch's, for any other class
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

    with swapped(torch.Tensor, _make_subclass=staticmethod(make_subclass)):
        yield


@contextlib.contextmanager
def pools_inline() -> Iterator[None]:
    """Work handed to a thread pool (transformers loads weights on four threads) run at once in
    the thread that hands it over: torch's modes — the fake one, the tracker, the allocation
    log — are per thread, and a pool thread would make real tensors no one counts."""
    from concurrent.futures import Future, ThreadPoolExecutor

    def submit(self: Any, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        done: Future = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            done.set_exception(exc)
        return done

    with swapped(ThreadPoolExecutor, submit=submit):
        yield


@contextlib.contextmanager
def data_follows_device() -> Iterator[None]:
    """``t.data = other`` on a fake tensor takes ``other``'s device too, as on real tensors: a
    fake tensor keeps its device in a Python attribute the C++ setter does not touch, so a
    parameter moved by ``.data =`` (``module.to("cuda")``, bitsandbytes quantising a weight on
    the GPU) would still say it is on the CPU, and the next operator would mix devices."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    base = torch._C.TensorBase.data

    def get(self: Any) -> Any:
        return base.__get__(self, type(self))

    def set_(self: Any, new: Any) -> None:
        base.__set__(self, new)
        if isinstance(new, FakeTensor):
            self.fake_device = new.fake_device

    with swapped(FakeTensor, data=property(get, set_)):
        yield


@contextlib.contextmanager
def cuda_optimizer_defaults(stand_in: bool) -> Iterator[None]:
    """An optimizer left to choose (``AdamW()``: ``foreach=None``) chooses as on CUDA: torch picks
    its multi-tensor (foreach) kernels only for plain tensors on a foreach device, and a fake
    tensor is neither (its type is not ``Tensor``; the stand-in's device is the CPU) — it would
    take the per-tensor loop, whose temporaries are one tensor's, not the whole model's. Fake
    tensors count as plain for the duration; with ``stand_in``, the CPU as CUDA."""
    import torch.optim.optimizer as optimizer
    import torch.utils._foreach_utils as foreach_utils
    from torch._subclasses.fake_tensor import FakeTensor

    lists = [getattr(m, "_foreach_supported_types", None) for m in (optimizer, foreach_utils)]
    lists = [x for x in lists if isinstance(x, list) and FakeTensor not in x]
    for x in lists:
        x.append(FakeTensor)
    real = getattr(optimizer, "_get_foreach_kernels_supported_devices", None)
    if stand_in and real is not None:
        optimizer._get_foreach_kernels_supported_devices = lambda: [*real(), "cpu"]
    try:
        yield
    finally:
        for x in lists:
            x.remove(FakeTensor)
        if stand_in and real is not None:
            optimizer._get_foreach_kernels_supported_devices = real

"""Fake tensors as a user's script needs them (:mod:`.child` runs the script under them).

* values read from a fake tensor (``loss.item()``, ``bool(t)``) are answered with placeholders
  (:data:`PLACEHOLDERS`), and where the script first read one is kept (:class:`Reads`);
* ``module.to(…)`` converts parameters in place as on real tensors
  (:func:`conversions_in_place`), ``copy.deepcopy`` of a fake tensor clones it
  (:func:`fake_deepcopy`), and a parameter subclass (bitsandbytes' ``Params4bit``) made of a
  fake tensor is a fake tensor of its class (:func:`parameter_subclasses`).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from collector.estimate.swap import swapped

__all__ = [
    "PLACEHOLDERS",
    "Reads",
    "conversions_in_place",
    "cuda_optimizer_defaults",
    "data_follows_device",
    "fake_deepcopy",
    "fake_mode",
    "parameter_subclasses",
    "place",
    "pools_inline",
]

PLACEHOLDERS = {"float": 1.0, "int": 1, "bool": False}  # what a read of a fake value answers


class Reads:
    """Where the script read a tensor's value (the first place, and how many reads)."""

    def __init__(self, script: Path | None = None) -> None:
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
            self.first = place(frames, self.script)


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


def fake_mode(reads: Reads, allow_real: bool = True) -> Any:
    """Torch's fake mode, answering a read of a value with a placeholder (:data:`PLACEHOLDERS`)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    scalar = aten._local_scalar_dense.default

    class ScriptFakeMode(FakeTensorMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
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
                reads.note()
                dtype = args[0].dtype
                if dtype == torch.bool:
                    return PLACEHOLDERS["bool"]
                return PLACEHOLDERS["float" if dtype.is_floating_point else "int"]
            return super().__torch_dispatch__(func, types, args, kwargs)

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

"""The script's two sides: the host runs for real, only the device is fake.

Under ``stepmem estimate --script`` a script's data side — datasets, samplers, index arithmetic,
NumPy, PIL, ``DataLoader`` workers, host tensors of any size — runs on real CPU tensors, with its
real values; what goes to the GPU is a fake tensor of its own size. The rules (:func:`real_op`,
asked by the fake mode of :mod:`collector.estimate.fakes` for every operator):

* an operator none of whose tensors is fake, on the host, makes real tensors: ``torch.randint``
  indices, ``torch.randperm`` for a shuffled sampler, ``torch.stack`` of a batch, ``.item()`` of
  a host value (no placeholder: the value is the real run's);
* except where the device is asked for: a factory with ``device="cuda"``, a host tensor moved by
  ``.to("cuda")``/``.cuda()`` — a fake of its own size, a view's bytes for a view, as CUDA
  copies it — and a module's weights made in its ``__init__`` (a model built on the host and
  moved is the model's shapes, not a real copy of its weights in host memory; an untrained
  model's values decide nothing);
* an operator with a fake tensor among its inputs is fake (a host tensor it reads is taken as a
  fake of itself); a device tensor copied back (``.cpu()``) is a fake on the host.

Without a GPU the CPU stands in for CUDA as its device 0 (:func:`stand_in`: ``cpu:0``, kept by
fake tensors; :mod:`.cuda_api` puts there what a script puts on ``"cuda"``), so the two sides
stay apart as on a GPU: the memory tracker and the allocation log count the device's tensors
only, a host tensor (real, or a fake copied back) is never GPU memory, and an operator mixing a
host tensor with a device one fails as on CUDA. ``DataLoader`` workers run the dataset with none
of the trace's modes (:func:`workers_plain`); on the CPU stand-in pinning host memory is a no-op
(:func:`pinning_on_stand_in`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from collector.estimate.swap import swapped

__all__ = ["on_host", "pinning_on_stand_in", "real_op", "stand_in", "workers_plain"]


def stand_in() -> Any:
    """The device standing in for CUDA without a GPU: the CPU's device 0 (``cpu:0``), which a
    fake tensor keeps, apart from the host's ``cpu`` (a real CPU tensor has no index)."""
    import torch

    return torch.device("cpu", 0)


def on_host(device: Any) -> bool:
    """Whether ``device`` (a ``torch.device``) is the host's: ``cpu``, not the stand-in's."""
    return device.type == "cpu" and device.index is None


def _constructing() -> bool:
    """Whether a module's ``__init__`` is running (its weights are made now), not a copy of a
    tensor it holds (``copy.deepcopy`` of a real one copies its storage: real too)."""
    from torch.nn import Module

    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_name
        if name in _COPIES:
            return False
        if name == "__init__" and isinstance(f.f_locals.get("self"), Module):
            return True
        f = f.f_back
    return False


_COPIES = frozenset({"__deepcopy__", "_deepcopy", "deepcopy"})


def real_op(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` runs for real, on the host (see the module doc)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_leaves

    device = kwargs.get("device")
    if device is not None and not on_host(torch.device(device)):
        return False  # the device's (on the stand-in: cpu:0), or the meta device
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(isinstance(t, FakeTensor) or not on_host(t.device) for t in tensors):
        return False  # a fake's, or a weight read as its shape (on the meta device)
    return bool(tensors) or not _constructing()


def _worker_loop(*args: Any, **kwargs: Any) -> Any:
    """A ``DataLoader`` worker's loop with none of the trace's modes (a forked worker inherits
    the thread's mode stack): the dataset runs on real tensors, as in the real run."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes
    from torch.utils.data._utils import worker

    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    loop = _REAL_LOOP[0] if _REAL_LOOP else worker._worker_loop  # (spawned: torch's own)
    with _disable_current_modes():
        return loop(*args, **kwargs)


_REAL_LOOP: list[Any] = []


@contextlib.contextmanager
def workers_plain() -> Iterator[None]:
    """``DataLoader`` workers started in the block run :func:`_worker_loop` (importable by name:
    a spawned worker imports it)."""
    from torch.utils.data._utils import worker

    _REAL_LOOP[:] = [worker._worker_loop]
    try:
        with swapped(worker, _worker_loop=_worker_loop):
            yield
    finally:
        _REAL_LOOP.clear()


@contextlib.contextmanager
def pinning_on_stand_in() -> Iterator[None]:
    """Pinning a host tensor does nothing on the CPU stand-in (there is no CUDA to pin it for:
    the ``DataLoader``'s pin thread, which runs outside the trace's modes, would raise). Pinned
    memory is the host's, not the GPU's, on a GPU as here."""
    import torch

    def pin_memory(self: Any, device: Any = None) -> Any:
        return self

    with swapped(torch.Tensor, pin_memory=pin_memory, is_pinned=lambda self, device=None: False):
        yield

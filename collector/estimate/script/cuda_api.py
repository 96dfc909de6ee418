"""``torch.cuda`` as a script under the estimate sees it on a machine without a GPU: CUDA
stood in for by the CPU (its memory queries are the estimate's on a GPU too:
:mod:`.counters`; the rest of ``torch.cuda`` — events, streams, graphs, RNG state —
:mod:`.stand_ins`).

* **CUDA on the CPU** (:func:`cuda_on_cpu`): ``torch.cuda.is_available()`` is true, one device
  (``torch.accelerator`` says the same: CUDA, one device, index 0);
  every tensor a script puts on ``"cuda"`` (``device=``, ``.to()``, ``.cuda()``, a module's
  ``.cuda()``) is made on the CPU, where the estimate's CUDA rules apply;
  ``torch.autocast("cuda")`` runs as the CPU's autocast with CUDA's cast lists
  (:func:`collector.estimate.cuda_rules.cuda_autocast`); ``synchronize`` and seeds do nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from collector.estimate.script.host import on_host, stand_in
from collector.estimate.script.stand_ins import Stream, stand_ins
from collector.estimate.swap import swapped

__all__ = ["cuda_on_cpu"]


class _Props:
    """What ``torch.cuda.get_device_properties`` says of the stand-in."""

    def __init__(self, name: str, total: int) -> None:
        self.name, self.total_memory = name, total
        self.major, self.minor, self.multi_processor_count = 9, 0, 132
        self.is_integrated, self.is_multi_gpu_board = False, False
        self.uuid = "GPU-stand-in"


def _is_cuda(d: Any) -> bool:
    import torch

    if isinstance(d, str):
        return d == "cuda" or d.startswith("cuda:")
    return isinstance(d, torch.device) and d.type == "cuda"


def _device_mode(fakes: bool) -> Any:
    """A ``TorchFunctionMode`` putting on the CPU what a call puts on CUDA: with ``fakes`` (the
    host side real, :mod:`.host`) on the stand-in's device (``cpu:0``), else on the CPU."""
    import torch
    from torch.overrides import TorchFunctionMode

    cpu = stand_in() if fakes else torch.device("cpu")

    class CudaOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.device and args and type(args[0]) is int and len(args) == 1:
                return torch.device("cuda", args[0])  # an index names the accelerator: CUDA
            if _is_cuda(kwargs.get("device")) or isinstance(kwargs.get("device"), int):
                kwargs["device"] = cpu
            if func is torch.Tensor.pin_memory:
                return args[0]
            asked = kwargs.get("device")
            if func is torch.Tensor.cuda:  # .cuda(device, non_blocking): on the stand-in
                func, args, kwargs = torch.Tensor.to, (args[0], cpu), {}
            if func is torch.Tensor.to:
                args = tuple(
                    cpu if _is_cuda(a) or (i == 1 and type(a) is int) else a
                    for i, a in enumerate(args)
                )
                asked = (
                    asked
                    if asked is not None
                    else next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)
                )
            out = func(*args, **kwargs)
            if fakes and _made_on_host(out, asked, cpu):
                # made on the CPU though the stand-in's device was asked for (torch.tensor(data,
                # device=…) moves in C++; the fake mode runs a one-element tensor for real):
                # the device's, of its size
                return torch.empty_strided(out.size(), out.stride(), dtype=out.dtype, device=cpu)
            return out

    return CudaOnCpu()


def _made_on_host(out: Any, device: Any, stand_in: Any) -> bool:
    """Whether a call asked for the stand-in's device (``device``) and made a host tensor (a real
    one, or a fake one of the host)."""
    import torch

    if device is None or not isinstance(out, torch.Tensor) or not on_host(out.device):
        return False
    try:
        return torch.device(device) == stand_in
    except (RuntimeError, TypeError):
        return False


@contextlib.contextmanager
def _autocast_seen(on_first: Callable[[Any], None], to_cpu: bool) -> Iterator[None]:
    """``on_first(dtype)`` at the script's first ``torch.autocast("cuda", …)``; with ``to_cpu``
    every one is entered as the CPU's autocast (CUDA's cast lists are installed then)."""
    import torch

    real_init = torch.autocast.__init__
    first = [True]

    def init(self: Any, device_type: str, dtype: Any = None, *args: Any, **kwargs: Any) -> None:
        if device_type == "cuda":
            dtype = dtype if dtype is not None else torch.float16  # CUDA's default
            if first[0] and kwargs.get("enabled", True):
                first[0] = False
                on_first(dtype)
            if to_cpu:
                device_type = "cpu"
        real_init(self, device_type, dtype, *args, **kwargs)

    with swapped(torch.autocast, __init__=init):
        yield


@contextlib.contextmanager
def cuda_on_cpu(
    name: str,
    capacity: int,
    on_autocast: Callable[[Any], None],
    real_cuda: bool,
    read: Callable[[], Any] = lambda: 0.0,
    fakes: bool = False,
) -> Iterator[None]:
    """CUDA stood in for by the CPU (see the module doc): one device called ``name`` of
    ``capacity`` bytes; ``on_autocast(dtype)`` at the script's first CUDA autocast; ``read()``
    a placeholder for a value of the device (:mod:`.stand_ins`); ``fakes``: the device's
    tensors are fake, the host's real, the device ``cpu:0`` (:func:`_device_mode`). With
    ``real_cuda`` (a GPU here) only the autocast's."""
    import torch

    if real_cuda:
        with _autocast_seen(on_autocast, to_cpu=False):
            yield
        return

    props = _Props(name, capacity)
    answers: dict[str, Callable[..., Any]] = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device=None: None,
        "get_device_name": lambda device=None: name,
        "get_device_properties": lambda device=None: props,
        "get_device_capability": lambda device=None: (9, 0),
        "is_bf16_supported": lambda *a, **k: True,
        "synchronize": lambda device=None: None,
        "is_initialized": lambda: True,
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "init": lambda: None,
        "_lazy_init": lambda: None,
    }
    cuda = torch.device("cuda", 0)
    accelerator: dict[str, Callable[..., Any]] = {  # torch.accelerator: CUDA, as on the GPU
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_accelerator": lambda check_available=False: cuda,
        "current_device_index": lambda: 0,
        "current_device_idx": lambda: 0,
        "set_device_index": lambda device: None,
        "set_device_idx": lambda device: None,
        "synchronize": lambda device=None: None,
        "current_stream": lambda device=None: Stream(cuda),
    }
    present = {k: v for k, v in accelerator.items() if hasattr(torch.accelerator, k)}
    with (
        swapped(torch.cuda, **answers),
        swapped(torch.accelerator, **present),
        stand_ins(read),
        _autocast_seen(on_autocast, to_cpu=True),
        _device_mode(fakes),
    ):
        yield

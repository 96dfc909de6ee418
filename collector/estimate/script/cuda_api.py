"""``torch.cuda`` as a script under the estimate sees it: its memory counters answered from the
estimate's own accounting, and — on a machine without a GPU — CUDA itself stood in for by the
CPU.

* **Memory counters** (on a GPU too: fake tensors hold no memory, so torch's own counters would
  say 0): ``memory_allocated``, ``memory_reserved``, their ``max_*``, ``memory_stats``,
  ``reset_peak_memory_stats``, ``empty_cache`` and ``mem_get_info`` are read from
  :class:`LiveAllocator`, which plays the allocation log through the caching-allocator model as
  the script runs. A script that prints them prints predicted values.
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

from collector.estimate.alloc_log import AllocationLog
from collector.estimate.allocator import AllocatorConfig, CachingAllocator
from collector.estimate.swap import swapped

__all__ = ["LiveAllocator", "counters_answered", "cuda_on_cpu"]


class LiveAllocator:
    """The allocator model fed the log's events as they happen: torch's counters, predicted."""

    def __init__(self, log: AllocationLog, config: AllocatorConfig) -> None:
        self.log = log
        self.model = CachingAllocator(config)
        self.handles: dict[Any, int] = {}
        self.seen = 0

    def sync(self) -> Any:
        events = self.log.events
        for kind, key, nbytes in events[self.seen :]:
            if kind == "a":
                self.handles[key] = self.model.malloc(nbytes, self.log.streams.get(key, 0))
            elif kind == "f":
                h = self.handles.pop(key, None)
                if h is not None:
                    self.model.free(h)
            elif kind == "e":
                self.model.empty_cache()
        self.seen = len(events)
        return self.model.stats

    def reset_peaks(self) -> None:
        self.sync()
        self.model.reset_peaks()

    def memory_stats(self) -> dict[str, int]:
        s = self.sync()
        out = {}
        for name, now, peak in (
            ("allocated_bytes", s.allocated, s.allocated_peak),
            ("reserved_bytes", s.reserved, s.reserved_peak),
        ):
            out[f"{name}.all.current"] = now
            out[f"{name}.all.peak"] = peak
        out["num_alloc_retries"] = s.num_alloc_retries
        return out


@contextlib.contextmanager
def counters_answered(live: LiveAllocator, capacity: int, outside: int) -> Iterator[None]:
    """``torch.cuda``'s memory counters answered by ``live`` (see the module doc); ``capacity``
    and ``outside`` (this process's memory outside torch) make ``mem_get_info``'s answer."""
    import torch

    def stat(name: str) -> Callable[..., int]:
        return lambda device=None: getattr(live.sync(), name)

    def empty_cache() -> None:
        live.log.events.append(("e", None, 0))

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        used = live.sync().reserved + outside
        return max(0, capacity - used), capacity

    answers = {
        "memory_allocated": stat("allocated"),
        "max_memory_allocated": stat("allocated_peak"),
        "memory_reserved": stat("reserved"),
        "max_memory_reserved": stat("reserved_peak"),
        "memory_stats": lambda device=None: live.memory_stats(),
        "reset_peak_memory_stats": lambda device=None: live.reset_peaks(),
        "reset_max_memory_allocated": lambda device=None: live.reset_peaks(),
        "empty_cache": empty_cache,
        "mem_get_info": mem_get_info,
    }
    accelerator = {  # torch.accelerator's memory queries (torch 2.8 on), the same answers
        "memory_allocated": answers["memory_allocated"],
        "max_memory_allocated": answers["max_memory_allocated"],
        "memory_reserved": answers["memory_reserved"],
        "max_memory_reserved": answers["max_memory_reserved"],
        "memory_stats": answers["memory_stats"],
        "reset_peak_memory_stats": answers["reset_peak_memory_stats"],
        "empty_cache": empty_cache,
        "get_memory_info": mem_get_info,
    }
    present = {k: v for k, v in accelerator.items() if hasattr(torch.accelerator, k)}
    with (
        swapped(torch.cuda, **answers),
        swapped(torch.cuda.memory, **answers),
        swapped(torch.accelerator, **present),
    ):
        yield


class _Stream:
    """What ``torch.accelerator.current_stream()`` gives on the stand-in: CUDA's default stream,
    never capturing a graph (the optimizers ask before each step)."""

    def __init__(self, device: Any) -> None:
        self.device, self.stream_id, self.device_index = device, 0, 0

    def is_capturing(self) -> bool:
        return False

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None


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


def _device_mode() -> Any:
    """A ``TorchFunctionMode`` putting on the CPU what a call puts on CUDA."""
    import torch
    from torch.overrides import TorchFunctionMode

    cpu = torch.device("cpu")
    moves = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.pin_memory}

    class CudaOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.device and args and type(args[0]) is int and len(args) == 1:
                return torch.device("cuda", args[0])  # an index names the accelerator: CUDA
            if _is_cuda(kwargs.get("device")) or isinstance(kwargs.get("device"), int):
                kwargs["device"] = cpu
            if func in moves:
                if func is not torch.Tensor.to:  # .cuda(), .pin_memory(): already there
                    return args[0]
                args = tuple(
                    cpu if _is_cuda(a) or (i == 1 and type(a) is int) else a
                    for i, a in enumerate(args)
                )
            return func(*args, **kwargs)

    return CudaOnCpu()


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
    name: str, capacity: int, on_autocast: Callable[[Any], None], real_cuda: bool
) -> Iterator[None]:
    """CUDA stood in for by the CPU (see the module doc): one device called ``name`` of
    ``capacity`` bytes; ``on_autocast(dtype)`` at the script's first CUDA autocast. With
    ``real_cuda`` (a GPU here) only that."""
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
        "current_stream": lambda device=None: _Stream(cuda),
    }
    present = {k: v for k, v in accelerator.items() if hasattr(torch.accelerator, k)}
    with (
        swapped(torch.cuda, **answers),
        swapped(torch.accelerator, **present),
        _autocast_seen(on_autocast, to_cpu=True),
        _device_mode(),
    ):
        yield

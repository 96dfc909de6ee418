"""What the rest of ``torch.cuda`` is on the CPU stand-in for CUDA (no GPU here): a script that
times its step with events, runs work on a side stream, marks NVTX ranges, saves the RNG state,
enters ``torch.cuda.device(0)``, captures a CUDA graph or asks NVML for the GPU's utilisation
runs as on the GPU, through stand-ins that do what the call means for memory and no more:

* ``Event`` (``record``, ``wait``, ``synchronize``, ``query``; ``elapsed_time`` is a value read
  from the device: a placeholder, counted with the other reads), ``Stream``/``ExternalStream``
  and ``torch.cuda.stream``/``set_stream``/``current_stream``/``default_stream`` (one stream: the
  stand-in runs everything in order);
* ``nvtx`` ranges and marks, ``ipc_collect``: nothing to do;
* the RNG state (``get_rng_state`` gives a CUDA generator's 16 bytes, on the host, as CUDA's
  does; ``set_rng_state``, ``seed``, ``initial_seed``), ``torch.cuda.device``/``device_of`` as
  contexts;
* ``cudart()``'s profiler start and stop (``torch.cuda.profiler``): nothing to do;
* ``CUDAGraph``, ``torch.cuda.graph`` and ``make_graphed_callables``: the captured code runs once,
  as the capture's own run (its tensors are the graph's memory); a replay runs nothing (the
  graph's private pool is not modelled apart from the caching allocator's: said in the notes);
* ``utilization``, ``temperature``, ``power_draw``, ``clock_rate``, ``memory_usage``: values of the
  device, answered with placeholders; ``list_gpu_processes`` says none runs; the sync debug mode
  is off; one device has no peer.

``caching_allocator_alloc``/``_delete`` are answered on a GPU too (:func:`raw_allocations`):
the bytes become a fake block of the estimate, as the caching allocator hands them out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from collector.estimate.swap import swapped

__all__ = ["Graphs", "NotModelled", "Stream", "raw_allocations", "stand_ins"]


class NotModelled(RuntimeError):
    """A call the estimate does not model, said by what it is and what to do instead: the
    estimate's gap, not the script's error."""


class _Cudart:
    """``torch.cuda.cudart()`` on the stand-in: the profiler's start and stop do nothing."""

    def cudaProfilerStart(self) -> int:
        return 0

    def cudaProfilerStop(self) -> int:
        return 0


class Stream:
    """A CUDA stream on the stand-in: CUDA's default stream, never capturing a graph (the
    optimizers ask before each step); work on it runs in order with everything else."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device, self.stream_id, self.device_index, self.priority = device, 0, 0, priority
        self.device_type = 1  # c10's DeviceType::CUDA

    def is_capturing(self) -> bool:
        return False

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _Event()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream)

    def __hash__(self) -> int:
        return 0


class _Event:
    """A CUDA event on the stand-in; ``elapsed_time`` is answered by ``read`` (a placeholder)."""

    read: Any = staticmethod(lambda: 0.0)

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **kwargs: Any) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: Any) -> float:
        return float(type(self).read())


class _DeviceContext:
    """``torch.cuda.device(i)`` / ``device_of(t)``: the one device, entered and left."""

    def __init__(self, device: Any = None) -> None:
        self.idx = 0

    def __enter__(self) -> _DeviceContext:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class Graphs:
    """CUDA graphs on the stand-in; ``captured`` counts the captures a script made."""

    captured = 0

    class Graph:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.pool_handle = (0, 0)

        def capture_begin(self, *args: Any, **kwargs: Any) -> None:
            Graphs.captured += 1

        def capture_end(self) -> None:
            return None

        def replay(self) -> None:
            return None

        def reset(self) -> None:
            return None

        def pool(self) -> tuple[int, int]:
            return self.pool_handle

        def enable_debug_mode(self) -> None:
            return None

        def debug_dump(self, path: str) -> None:
            return None

    class Capture:
        """``with torch.cuda.graph(g): …``: the body runs once, as the capture's run."""

        def __init__(self, cuda_graph: Any, *args: Any, **kwargs: Any) -> None:
            self.graph = cuda_graph

        def __enter__(self) -> None:
            self.graph.capture_begin()

        def __exit__(self, *exc: Any) -> None:
            self.graph.capture_end()

    @staticmethod
    def graphed(callables: Any, sample_args: Any, *args: Any, **kwargs: Any) -> Any:
        """``make_graphed_callables``: the callables themselves (they run eagerly)."""
        Graphs.captured += 1
        return callables


@contextlib.contextmanager
def stand_ins(read: Any) -> Iterator[None]:
    """The stand-ins of the module doc, for the block. ``read()``: a placeholder for a value
    of the device (counted as a read)."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    _Event.read = staticmethod(read)
    Graphs.captured = 0

    def state(device: Any = "cuda") -> Any:
        with unset_fake_temporarily():  # on the host, as CUDA's is
            return torch.zeros(16, dtype=torch.uint8)

    nothing = lambda *a, **k: None  # noqa: E731
    answers: dict[str, Any] = {
        "Event": _Event,
        "Stream": Stream,
        "ExternalStream": Stream,
        "stream": lambda stream=None: contextlib.nullcontext(stream),
        "set_stream": nothing,
        "current_stream": lambda device=None: Stream(device),
        "default_stream": lambda device=None: Stream(device),
        "device": _DeviceContext,
        "device_of": _DeviceContext,
        "ipc_collect": nothing,
        "get_rng_state": state,
        "get_rng_state_all": lambda: [state()],
        "set_rng_state": nothing,
        "set_rng_state_all": nothing,
        "seed": nothing,
        "seed_all": nothing,
        "initial_seed": lambda: 0,
        "CUDAGraph": Graphs.Graph,
        "graph": Graphs.Capture,
        "make_graphed_callables": Graphs.graphed,
        "is_current_stream_capturing": lambda: False,
        "graph_pool_handle": lambda: (0, 0),
        "utilization": lambda device=None: int(read()),
        "temperature": lambda device=None: int(read()),
        "power_draw": lambda device=None: int(read()),
        "clock_rate": lambda device=None: int(read()),
        "memory_usage": lambda device=None: int(read()),
        "list_gpu_processes": lambda device=None: "GPU:0\nno processes are running",
        "get_sync_debug_mode": lambda: 0,
        "set_sync_debug_mode": nothing,
        "can_device_access_peer": lambda device, peer: False,  # one device
        "is_tf32_supported": lambda: True,
        "cudart": _Cudart,
    }
    nvtx = {n: nothing for n in ("range_push", "range_pop", "range_start", "range_end", "mark")}
    with swapped(torch.cuda, **answers), swapped(torch.cuda.nvtx, **nvtx):
        yield


@contextlib.contextmanager
def raw_allocations(device: Any) -> Iterator[None]:
    """``caching_allocator_alloc(size)`` as a fake block of ``size`` bytes on ``device`` (the
    estimate's, on a GPU too), ``caching_allocator_delete(ptr)`` its free."""
    import torch

    held: dict[int, Any] = {}
    next_ptr = [1 << 40]

    def alloc(size: int, device_arg: Any = None, stream: Any = None) -> int:
        block = torch.empty(int(size), dtype=torch.uint8, device=device)
        ptr = next_ptr[0]
        next_ptr[0] += max(512, -(-int(size) // 512) * 512)
        held[ptr] = block
        return ptr

    def delete(ptr: int) -> None:
        held.pop(int(ptr), None)

    values = {"caching_allocator_alloc": alloc, "caching_allocator_delete": delete}
    try:
        with swapped(torch.cuda, **values), swapped(torch.cuda.memory, **values):
            yield
    finally:
        held.clear()

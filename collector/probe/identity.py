"""Who the probe speaks for: this process's rank in its training, the GPU it reports as (a CUDA
device's NVML UUID, or the one a CPU rank stands in for in CI) and how its caching allocator is set
up. Read from torch and from the environment torchrun, Ray Train and PyTorch set."""

from __future__ import annotations

import os
import sys

from collector.model.records import Stat

CPU_AS_ENV = "STEPMEM_CPU_AS"  # a GPU UUID a CPU-only probe reports as (CPU ranks in CI)


def allocator_mode() -> dict[str, int]:
    """How this process's CUDA caching allocator is set up, from the environment PyTorch reads:
    caching off (``PYTORCH_NO_CUDA_MEMORY_CACHING``: every free goes back to the driver and the
    allocator's statistics stay 0) and expandable segments (``PYTORCH_CUDA_ALLOC_CONF`` or
    ``PYTORCH_ALLOC_CONF`` with ``expandable_segments:True``)."""
    names = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    conf = ",".join(os.environ.get(k, "") for k in names)
    conf = conf.replace(" ", "").lower()
    no_cache = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "")
    return {
        Stat.PROCESS_PID: os.getpid(),
        Stat.CACHING_DISABLED: int(no_cache not in ("", "0")),
        Stat.EXPANDABLE_SEGMENTS: int("expandable_segments:true" in conf),
    }


def distributed_identity() -> tuple[int, int, int | None, bool]:
    """This process's (rank, world size, local rank or None, whether torch.distributed is
    initialized): from ``torch.distributed`` once its process group exists, else from the
    environment torchrun and Ray Train set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), else a
    single process (0, 1). Values that contradict each other (a rank outside the world) fall
    back to a single process rather than reach the sampler as events it must refuse."""
    rank = world = local = None
    initialized = False
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world, initialized = dist.get_rank(), dist.get_world_size(), True
    except Exception:  # a half-torn-down process group: the environment still tells
        pass

    def env(name: str) -> int | None:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            return None

    if rank is None:
        rank, world = env("RANK"), env("WORLD_SIZE")
    local = env("LOCAL_RANK")
    if rank is None or world is None or not (0 <= rank < world):
        rank, world = 0, 1
    return rank, world, local, initialized


def cpu_stands_in_for() -> str | None:
    """The GPU UUID a CPU-only process reports as, from ``STEPMEM_CPU_AS`` (a comma-separated
    list: the one at this process's ``LOCAL_RANK``, modulo its length; without ``LOCAL_RANK``
    — ``torch.multiprocessing.spawn`` sets none — its rank), so CPU ranks stand in for the GPUs
    a replay simulates (CI has no GPU) one GPU a rank, as torchrun's do; None when unset."""
    uuids = [u for u in os.environ.get(CPU_AS_ENV, "").split(",") if u.strip()]
    if not uuids:
        return None
    rank, _, local, _ = distributed_identity()
    return uuids[(rank if local is None else local) % len(uuids)].strip()


def cuda_uuid(device: int) -> str:
    """NVML-style UUID (``GPU-…``) of CUDA device ``device`` as this process numbers it."""
    import torch

    raw = str(torch.cuda.get_device_properties(device).uuid)
    return raw if raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"

"""Workloads that each show one memory pattern the report must name, by a known amount.

* ``leak`` — every step keeps ``--leak-mib`` of its output alive (a list that is never cleared,
  the classic "appended the loss tensor" bug): torch allocated, reserved and NVML grow by that
  much every step; there is no steady state.
* ``allocator`` — the live working set is the same size every step, but it comes in blocks
  that grow for ``--grow-steps`` steps (``--block-mib`` × 1, 1.5, 2, …): the cached blocks of
  the previous step are too small for the new ones, so the allocator reserves new segments
  each time. Reserved jumps while the within-step allocated peak stays flat; then the block size
  stays and so does memory.
* ``oom`` — a leak of ``--leak-mib`` a step (default 12 GiB) that runs until the card is full:
  the step that cannot allocate dies of ``torch.cuda.OutOfMemoryError`` (re-raised, as a training
  job would die).
* ``outside`` — from step ``--extra-from`` until step ``--extra-to`` begins, ``--extra-mib``
  (default 4096) is held by a raw ``cuMemAlloc`` of this process, outside PyTorch's allocator
  (as NCCL, cuBLAS workspaces or another library's own allocations are): NVML sees it, torch's
  statistics do not.
* ``neighbour`` — over the same steps a second process allocates ``--extra-mib`` on the same GPU
  (PyTorch in a child process, holding it until told to stop).

Each step does a little matrix work on a resident ``--base-mib`` working set and lasts at least
``--step-ms``, so a 1 kHz sampler sees every step.

    python -m workloads.patterns --pattern leak --steps 20
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any

from workloads import add_common_args, finish, script_args

MIB = 1 << 20
PATTERNS = ("leak", "allocator", "oom", "outside", "neighbour")
OOM_NEEDS_GPU = "the oom pattern needs a GPU (it fills the card until it fails)"
NEEDS_GPU = {
    "oom": OOM_NEEDS_GPU,
    "outside": "the outside pattern needs a GPU (it allocates with the CUDA driver)",
    "neighbour": "the neighbour pattern needs a GPU (a second process allocates on it)",
}


class _RawAllocation:
    """Device memory from the CUDA driver (``cuMemAlloc``) in this process's primary context:
    memory PyTorch's allocator never sees."""

    def __init__(self, nbytes: int) -> None:
        import ctypes

        import torch

        torch.cuda.init()
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.ptr = ctypes.c_uint64(0)
        rc = self.cuda.cuMemAlloc_v2(ctypes.byref(self.ptr), ctypes.c_size_t(nbytes))
        if rc == 201:  # CUDA_ERROR_INVALID_CONTEXT: make the primary context current first
            ctx, dev = ctypes.c_void_p(), ctypes.c_int(0)
            self.cuda.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device())
            self.cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
            self.cuda.cuCtxSetCurrent(ctx)
            rc = self.cuda.cuMemAlloc_v2(ctypes.byref(self.ptr), ctypes.c_size_t(nbytes))
        if rc != 0:
            raise RuntimeError(f"cuMemAlloc of {nbytes} bytes failed with CUDA error {rc}")
        self.cuda.cuMemsetD8_v2(self.ptr, ctypes.c_ubyte(1), ctypes.c_size_t(nbytes))

    def free(self) -> None:
        if self.ptr.value:
            self.cuda.cuMemFree_v2(self.ptr)
            self.ptr.value = 0


_NEIGHBOUR = (
    "import sys, torch\n"
    "x = torch.ones(int(sys.argv[1]), dtype=torch.uint8, device='cuda')\n"
    "torch.cuda.synchronize()\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


class _Neighbour:
    """A second process holding ``nbytes`` on this process's GPU until :meth:`free`."""

    def __init__(self, nbytes: int) -> None:
        import os
        import subprocess

        import torch

        from collector.probe.core import EVENTS_ENV

        visible = _visible_index(torch.cuda.current_device())
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible)
        env.pop(EVENTS_ENV, None)  # the neighbour is not a step probe
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _NEIGHBOUR, str(nbytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the neighbour process did not allocate its memory")

    def free(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _visible_index(device: int) -> str:
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[device] if visible else str(device)


def _block_bytes(args: argparse.Namespace, step: int) -> int:
    """The ``allocator`` pattern's block size at ``step`` (1-based): grows by half the first
    block each step for ``grow_steps`` steps, then stays."""
    k = min(step, args.grow_steps + 1) - 1
    return int(args.block_mib * MIB * (1 + 0.5 * k))


def run(args: argparse.Namespace, probe: Any = None) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if args.pattern in NEEDS_GPU and not cuda:
        raise RuntimeError(NEEDS_GPU[args.pattern])
    base = torch.randn(args.base_mib * MIB // 4, device=dev)
    w = torch.randn(1024, 1024, device=dev)
    out = torch.empty(1024, 1024, device=dev)
    kept: list[Any] = []
    extra: Any = None  # the outside allocation or the neighbour process, while it lives
    times: list[float] = []
    plan: list[dict[str, Any]] = []
    steps = args.steps if args.pattern != "oom" else max(args.steps, 10_000)
    for i in range(1, steps + 1):
        t0 = time.perf_counter()
        # a step that raises (the OOM) is recorded as failed by the probe, then goes on
        with probe.step(i) if probe is not None else contextlib.nullcontext():
            torch.matmul(base[: 1024 * 1024].view(1024, 1024), w, out=out)
            entry: dict[str, Any] = {"step": i}
            if args.pattern in ("outside", "neighbour"):
                if i == args.extra_from:
                    made = _RawAllocation if args.pattern == "outside" else _Neighbour
                    extra = made(args.extra_mib * MIB)
                entry["extra_bytes"] = args.extra_mib * MIB if extra is not None else 0
            elif args.pattern in ("leak", "oom"):
                t = torch.empty(args.leak_mib * MIB // 4, device=dev)
                t.fill_(1.0)
                kept.append(t)  # never freed: the leak
                entry["kept_bytes"] = len(kept) * args.leak_mib * MIB
            else:
                size = _block_bytes(args, i)
                n = max(1, (args.working_mib * MIB) // size)
                blocks = [torch.empty(size // 4, device=dev) for _ in range(n)]
                for b in blocks:
                    b.fill_(1.0)
                entry.update(block_bytes=size, blocks=n)
                del blocks, b  # freed to the allocator's cache, not to the driver
            if cuda:
                torch.cuda.synchronize()
            rest = args.step_ms / 1000 - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
        times.append(time.perf_counter() - t0)
        plan.append(entry)
        if extra is not None and i + 1 == args.extra_to:  # gone before step extra_to begins
            extra.free()
            extra = None
        if args.pause_ms:
            time.sleep(args.pause_ms / 1000)
    if extra is not None:
        extra.free()
    return {
        "workload": f"patterns:{args.pattern}",
        "pattern": args.pattern,
        "steps": len(times),
        "plan": plan,
        "step_times_s": times,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="patterns", description=__doc__.splitlines()[0])
    p.add_argument("--pattern", choices=PATTERNS, required=True)
    p.add_argument("--steps", type=int, default=20, help="steps (oom: runs until it fails)")
    p.add_argument("--leak-mib", type=int, default=None, help="kept per step (leak, oom)")
    p.add_argument("--block-mib", type=int, default=256, help="first block size (allocator)")
    p.add_argument("--working-mib", type=int, default=4096, help="live blocks a step (allocator)")
    p.add_argument("--grow-steps", type=int, default=3, help="steps whose blocks grow (allocator)")
    p.add_argument("--step-ms", type=float, default=100.0, help="shortest step (ms)")
    p.add_argument("--extra-mib", type=int, default=4096, help="outside / neighbour (MiB)")
    p.add_argument("--extra-from", type=int, default=3, help="outside / neighbour: first step")
    p.add_argument("--extra-to", type=int, default=6, help="outside / neighbour: gone by this step")
    add_common_args(p)
    return p


def check(args: argparse.Namespace) -> None:
    """``ValueError`` naming a bad value."""
    for name in ("steps", "leak_mib", "block_mib", "working_mib", "extra_mib", "extra_from"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.base_mib < 4:
        raise ValueError("--base-mib must be >= 4 (the step's matrix work reads 4 MiB of it)")
    if args.grow_steps < 0 or args.step_ms < 0 or args.pause_ms < 0:
        raise ValueError("--grow-steps, --step-ms and --pause-ms must be >= 0")


def defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill pattern-dependent defaults."""
    if args.leak_mib is None:
        args.leak_mib = 12 * 1024 if args.pattern == "oom" else 256
    return args


def main(argv: list[str] | None = None) -> int:
    p, args = script_args(sys.modules[__name__], argv)
    import torch

    if args.pattern in NEEDS_GPU and not torch.cuda.is_available():
        p.error(NEEDS_GPU[args.pattern])
    from collector.probe.core import StepProbe

    probe = None if args.no_probe else StepProbe()
    return finish(run(defaults(args), probe), probe, args.summary)


if __name__ == "__main__":
    sys.exit(main())

"""Data-parallel training of a Llama built from a config — DDP or FSDP2 — one process a rank, each
rank with its own step probe: under ``torchrun``, in Ray Train workers, under
``torch.multiprocessing.spawn``, or alone (a process group of one).

FSDP2 shards each decoder layer and the root (``fully_shard``); DDP wraps the model
(``--bucket-view`` sets ``gradient_as_bucket_view``). Gradients are zeroed at the start of each
step (``zero_grad()``), so at a step's end they are still there and the ledger shows them next to
the parameters and optimizer state. Data: random tokens, different on each rank.

``--imbalance RANK:MIB:FROM_STEP`` makes one rank keep MIB more from a step on (a bigger batch
or a cache on one rank in real jobs), to see the imbalance finding. ``--track FILE`` runs step 2
under PyTorch's own memory tracker (``FSDPMemTracker`` for FSDP2, ``MemTracker`` otherwise) and
writes, per rank, its categories next to the probe's ledger for that step.

    torchrun --standalone --nproc-per-node 2 -m workloads.distributed --shard fsdp2 --steps 5
    python -m workloads.distributed --shard ddp --size 1b --steps 4     # one GPU, world size 1
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from collector.model.kinds import Phase
from workloads import script_args

SHARDS = ("fsdp2", "ddp", "none")
MIB = 1 << 20
TRACK_STEP = 2


def _init_group(backend: str | None = None) -> tuple[Any, bool]:
    """torch.distributed, initialized here unless the launcher (Ray Train) did: from torchrun's
    environment, else a group of one; NCCL on GPUs, gloo on the CPU (or ``backend``: gloo lets
    several ranks share one GPU). Returns (dist, whether this function made the group)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist, False
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend)
    else:
        store = Path(tempfile.mkdtemp(prefix="stepmem-dist-")) / "store"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    return dist, True


def _device() -> Any:
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        local = torch.cuda.current_device()
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def build(args: argparse.Namespace, device: Any) -> Any:
    """The model on ``device``, wrapped as ``args.shard`` says."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from collector.estimate.spec import SHAPES

    config = LlamaConfig(
        **SHAPES[args.size], max_position_embeddings=max(args.seq_len, 128), use_cache=False
    )
    torch.manual_seed(0)  # the same initial weights on every rank
    with device:
        model = LlamaForCausalLM(config)
    if args.shard == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(
            model, device_ids=ids, gradient_as_bucket_view=args.bucket_view
        )
    elif args.shard == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def _tracker(args: argparse.Namespace, model: Any, optimizer: Any) -> Any:
    if args.shard == "fsdp2":
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(model, optimizer)
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(model, optimizer)
    return mt


def _tracked(tracker: Any) -> dict[str, Any]:
    """What PyTorch's tracker saw: its categories after the step (``current``), and for FSDP2
    the most unsharded-parameter bytes over its module snapshots."""
    out: dict[str, Any] = {
        which: {
            str(d): {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
            for d, snap in tracker.get_tracker_snapshot(which).items()
        }
        for which in ("current", "peak")
    }
    unsharded = 0
    for stats in getattr(tracker, "memory_tracking", {}).values():
        for snaps in getattr(stats, "snapshots", {}).values():
            for snap in snaps:
                for dev_snap in snap.values():
                    for k, v in dev_snap.items():
                        if getattr(k, "value", k) == "Unsharded Param":
                            unsharded = max(unsharded, int(v))
    out["unsharded_param_peak"] = unsharded
    return out


def run(args: argparse.Namespace, probe: Any = None) -> dict[str, Any]:
    """Train ``args.steps`` steps on this rank; returns its summary."""
    import torch

    dist, made = _init_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    model = build(args, device)
    # foreach: CUDA's default, named so that CPU ranks take the same step (their default is off)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    if probe is not None:
        probe.watch(model, optimizer)
    vocab = model.config.vocab_size if hasattr(model, "config") else 512
    g = torch.Generator().manual_seed(1 + rank)
    extra = _imbalance(args.imbalance, rank)
    kept: list[Any] = []
    times, losses, tracked = [], [], None
    try:
        for step in range(1, args.steps + 1):
            ids = torch.randint(0, vocab, (args.batch, args.seq_len), generator=g).to(device)
            t0 = time.perf_counter()
            tracker = (
                _tracker(args, model, optimizer) if args.track and step == TRACK_STEP else None
            )
            if probe is not None:
                probe.begin(step)
            with tracker if tracker is not None else _nothing():
                optimizer.zero_grad(set_to_none=False)
                if extra and step >= extra[1]:
                    kept.append(torch.empty(extra[0], dtype=torch.uint8, device=device).fill_(1))
                    extra = None
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                if probe is not None:
                    probe.phase(Phase.OPTIMIZER)
                optimizer.step()
            if probe is not None:
                probe.end()
            if tracker is not None:
                tracked = _tracked(tracker)
                tracked["ledger"] = probe.records[-1]["ledger"] if probe is not None else {}
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
    finally:
        if probe is not None:
            probe.close()
    if tracked is not None:
        Path(f"{args.track}.rank{rank}.json").write_text(json.dumps(tracked, indent=1))
    summary = {
        "workload": "distributed",
        "shard": args.shard,
        "size": args.size,
        "rank": rank,
        "world_size": world,
        "device": str(device),
        "step_times_s": times,
        "losses": losses,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if made:
        dist.destroy_process_group()
    return summary


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _imbalance(text: str | None, rank: int) -> tuple[int, int] | None:
    """(bytes, from step) this rank keeps extra, from ``RANK:MIB:FROM_STEP``."""
    if not text:
        return None
    r, mib, step = (int(x) for x in text.split(":"))
    return (mib * MIB, step) if r == rank else None


def check(args: argparse.Namespace) -> None:
    if args.imbalance:
        parts = args.imbalance.split(":")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--imbalance {args.imbalance!r} is not RANK:MIB:FROM_STEP")


def parser() -> argparse.ArgumentParser:
    from collector.args import positive_int
    from collector.estimate.spec import SHAPES

    p = argparse.ArgumentParser(prog="distributed", description=__doc__.splitlines()[0])
    p.add_argument("--shard", choices=SHARDS, default="fsdp2", help="default fsdp2")
    p.add_argument("--size", choices=sorted(SHAPES), default="tiny", help="default tiny")
    p.add_argument("--steps", type=positive_int, default=4)
    p.add_argument("--seq-len", type=positive_int, default=64)
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--bucket-view", action="store_true", help="DDP: gradient_as_bucket_view=True")
    p.add_argument("--imbalance", metavar="RANK:MIB:FROM_STEP", help="one rank keeps more")
    p.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        help="process group backend when this process makes the group (default: nccl on a "
        "GPU, gloo on the CPU; gloo lets ranks share one GPU)",
    )
    p.add_argument("--track", metavar="FILE", help="step 2 under PyTorch's memory tracker")
    p.add_argument("--no-probe", action="store_true")
    p.add_argument("--summary", type=Path, help="also write this rank's summary (JSON) here")
    return p


def main(argv: list[str] | None = None) -> int:
    _, args = script_args(__import__("workloads.distributed", fromlist=["x"]), argv)
    from collector.probe.core import StepProbe

    probe = None if args.no_probe else StepProbe()
    summary = run(args, probe)
    text = json.dumps(summary, indent=1)
    if args.summary:
        Path(f"{args.summary}.rank{summary['rank']}.json").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Two DDP ranks started with ``torch.multiprocessing.spawn`` on the machine's one GPU (gloo: NCCL
will not put two ranks on one device), each with its own step probe: the case whose events were
all lost before the spool. Arguments after the script go to ``workloads.distributed``.

    stepmem run --script benchmarks/device/spawn_ranks.py -- --shard ddp --backend gloo --steps 6
"""

from __future__ import annotations

import os
import socket
import sys

import torch.multiprocessing as mp


def rank(r: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(
        RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )  # fmt: skip
    from collector.probe.core import StepProbe
    from workloads import distributed

    args = distributed.parser().parse_args(argv)
    summary = distributed.run(args, StepProbe())
    print(f"rank {r}: {len(summary['step_times_s'])} steps", flush=True)


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank, args=(2, port, sys.argv[1:]), nprocs=2)

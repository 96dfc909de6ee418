"""A script whose micro-batch is its own option (``--batch-size``): what
``stepmem estimate --script … --max-batch --batch-arg batch-size`` searches. ``--fraction F``
caps torch as ``set_per_process_memory_fraction(F)`` (a smaller card on a large one); ``--json``
prints torch's counters after the last step (real on a GPU, the estimate's under it).

    python benchmarks/scripts/searched.py --batch-size 100 [--fraction 0.04] [--json]
"""

import argparse
import json
import sys

import torch

from collector.probe.core import StepProbe

ap = argparse.ArgumentParser()
ap.add_argument("--batch-size", type=int, default=4)
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--fraction", type=float, default=None)
ap.add_argument("--json", action="store_true")
a = ap.parse_args()
dev = torch.device("cuda")
if a.fraction is not None:
    torch.cuda.set_per_process_memory_fraction(a.fraction)
m = torch.nn.Sequential(
    torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
).to(dev)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
probe = StepProbe().watch(m, opt)
for i in range(a.steps):
    with probe.step(i):
        m(torch.randn(a.batch_size, 256, 1024, device=dev)).square().mean().backward()
        opt.step()
        opt.zero_grad()
if a.json:
    s = torch.cuda.memory_stats()
    keys = ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "segment.all.current")
    print(json.dumps({k: s[k] for k in keys}), file=sys.stderr)

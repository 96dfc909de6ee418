"""fp16 training with ``torch.amp.GradScaler`` (the mixed-precision recipe of the PyTorch docs):
four 4096-wide layers, AdamW, the probe's lines; torch's counters printed at every step end as
one JSON line (under ``stepmem estimate --script`` they print the estimate's predictions).

    python benchmarks/scripts/fp16_scaler.py --batch 32 --steps 4
"""

import argparse
import json

import torch

from collector.probe.core import StepProbe

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=32)
p.add_argument("--width", type=int, default=4096)
p.add_argument("--steps", type=int, default=4)
a = p.parse_args()

torch.manual_seed(0)
layers = [torch.nn.Linear(a.width, a.width) for _ in range(4)]
model = torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.GELU())]).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
scaler = torch.amp.GradScaler("cuda")
probe = StepProbe().watch(model, opt)
for i in range(a.steps):
    x = torch.randn(a.batch, a.width, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    with probe.step(i):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        probe.phase("optimizer")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    print(
        json.dumps(
            {
                "step": i,
                "allocated": torch.cuda.memory_allocated(),
                "peak": torch.cuda.max_memory_allocated(),
                "optimizer_state": sum(
                    t.numel() * t.element_size()
                    for s in opt.state.values()
                    for t in s.values()
                    if torch.is_tensor(t) and t.is_cuda
                ),
            }
        ),
        flush=True,
    )
probe.close()

"""A plain loop as a memory-minded user writes it: a model in bf16 autocast with gradient
checkpointing, ``adamw_torch``, and torch's own counters printed at every step (under
``stepmem estimate --script`` they print the estimate's predictions).

    python benchmarks/scripts/plain_adamw.py MODEL_DIR --batch 4 --seq-len 1024
"""

import argparse

import torch
from transformers import AutoModelForCausalLM

from collector.probe.core import StepProbe

p = argparse.ArgumentParser()
p.add_argument("model", help="a local folder (config.json and safetensors)")
p.add_argument("--batch", type=int, default=2)
p.add_argument("--seq-len", type=int, default=64)
p.add_argument("--steps", type=int, default=4)
a = p.parse_args()

torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
model.gradient_checkpointing_enable()
model.config.use_cache = False
model.cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
torch.cuda.empty_cache()
torch.cuda.reset_peak_memory_stats()
probe = StepProbe().watch(model, opt)
for i in range(a.steps):
    ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq_len)).to("cuda")
    with probe.step(i):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        probe.phase("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    gib = 2**30
    print(
        f"step {i}: loss {loss.item():.3f} allocated {torch.cuda.memory_allocated() / gib:.2f} "
        f"GiB, peak {torch.cuda.max_memory_allocated() / gib:.2f}, reserved "
        f"{torch.cuda.memory_reserved() / gib:.2f}"
    )
probe.close()

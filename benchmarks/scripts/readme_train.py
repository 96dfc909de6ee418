"""The README's example, as a script: a causal LM from a local folder, PyTorch's AdamW, and the
probe's lines around each step of a plain loop.

    python benchmarks/scripts/readme_train.py MODEL_DIR --batch 4 --seq-len 512
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

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
ids = torch.randint(0, model.config.vocab_size, (a.steps * a.batch, a.seq_len))
loader = torch.utils.data.DataLoader(
    [{"input_ids": x, "labels": x} for x in ids], batch_size=a.batch
)

probe = StepProbe().watch(model, optimizer)  # any loop
for i, batch in enumerate(loader, start=1):
    batch = {k: v.to(device) for k, v in batch.items()}
    with probe.step(i):
        loss = model(**batch).loss
        loss.backward()
        probe.phase("optimizer")
        optimizer.step()
        optimizer.zero_grad()
    print(f"step {i}: loss {loss.item():.3f}")
probe.close()

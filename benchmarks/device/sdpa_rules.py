"""CUDA's own choice of attention kernel over a grid of layouts, on this GPU (#29): what
``torch._fused_sdp_choice`` answers for training inputs (requiring grad) of each dtype, head
size, mask, dropout and grouped key/value heads. ``tests/test_cuda_rules.py`` holds
``collector.estimate.cuda_rules.cuda_sdpa_choice`` (the CPU stand-in's rules) to this file.

    python benchmarks/device/sdpa_rules.py > benchmarks/results/fit/sdpa-choices.json   # on a GPU
"""

import itertools
import json

import torch

NAMES = {-1: "error", 0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
rows = []
dev = torch.device("cuda")
for dtype, head, mask, dropout, gqa in itertools.product(
    (torch.bfloat16, torch.float16, torch.float32),
    (32, 64, 80, 96, 100, 128, 160, 256, 320),
    (False, True),
    (0.0, 0.1),
    (False, True),
):
    heads, kv = 8, (2 if gqa else 8)
    q = torch.zeros(2, heads, 128, head, device=dev, dtype=dtype, requires_grad=True)
    k = torch.zeros(2, kv, 128, head, device=dev, dtype=dtype, requires_grad=True)
    m = torch.zeros(2, 1, 128, 128, device=dev, dtype=dtype) if mask else None
    c = torch._fused_sdp_choice(q, k, k, m, dropout, not mask, scale=None, enable_gqa=gqa)
    rows.append(
        {
            "dtype": str(dtype).removeprefix("torch."),
            "head_dim": head,
            "mask": mask,
            "dropout": dropout,
            "gqa": gqa,
            "choice": NAMES.get(int(c), str(int(c))),
        }
    )
print(
    json.dumps(
        {
            "gpu": torch.cuda.get_device_name(),
            "capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__,
            "choices": rows,
        },
        indent=0,
    )
)

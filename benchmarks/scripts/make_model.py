"""A model folder to train from without downloading one: ``config.json`` of a built-in Llama shape
and a ``model.safetensors`` of zeros, written sparse (the header, then a hole: no weight bytes are
written or read back from disk). The estimate reads only the header; a live run loads zeros.

    python benchmarks/scripts/make_model.py 7b /tmp/llama-7b
"""

import argparse
import json
import math
import os
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from collector.estimate.spec import SHAPES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("size", choices=sorted(SHAPES))
    p.add_argument("out", type=Path)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    a = p.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[a.size], max_position_embeddings=4096, torch_dtype=a.dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    width = 2 if a.dtype == "bfloat16" else 4
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        n = math.prod(t.shape) * width
        dtype = "BF16" if width == 2 else "F32"
        header[name] = {
            "dtype": dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    a.out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(a.out)
    with open(a.out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # the weights: a hole of zeros
    os.sync()
    print(f"{a.out}: {a.size}, {offset / 2**30:.2f} GiB of {a.dtype} zeros (sparse)")


if __name__ == "__main__":
    main()

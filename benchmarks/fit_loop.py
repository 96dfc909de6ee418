"""The loop ``stepmem estimate`` predicts, run for real on a GPU under stepmem's probe: a model
built as the estimate builds it (a built-in shape or a Hugging Face config), PyTorch's AdamW,
bf16 autocast and activation checkpointing unless turned off, ``--grad-accum`` micro-batches a
step, ``zero_grad(set_to_none=True)``. What a user's plain training loop looks like, and the
measured side of ``benchmarks/results/fit``.

    python benchmarks/fit_loop.py --size 3b --seq-len 2048 --batch 4 --steps 3
    python benchmarks/fit_loop.py --config benchmarks/configs/gpt2-medium.json --no-checkpointing

``--card-gib G`` limits torch's allocator to what a card of G GiB (nvidia-smi's total) leaves it
(``torch.cuda.set_per_process_memory_fraction``: G less what the driver keeps and the process's
memory outside torch — the very bytes ``stepmem estimate --gpu G`` holds a step against,
``collector.estimate.fit.limit_of`` — as a share of this GPU): a step that would not fit such a
card runs out of memory here. The last line printed is the run's summary (JSON), ``"oom":
true`` when it ran out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default=None, help="a built-in shape (collector.estimate.spec)")
    p.add_argument("--config", type=Path, help="a Hugging Face config.json instead")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument("--no-bf16", action="store_true")
    p.add_argument("--card-gib", type=float, help="limit torch to what a card this large leaves")
    p.add_argument("--no-probe", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    import torch

    from collector.estimate import build
    from collector.estimate.spec import Spec, read_config
    from collector.probe.core import StepProbe

    args = parser().parse_args(argv)
    spec = Spec(
        size=None if args.config else (args.size or "small"),
        config=read_config(args.config) if args.config else None,
        seq_len=args.seq_len,
        batch=args.batch,
        grad_accum=args.grad_accum,
        checkpointing=not args.no_checkpointing,
        bf16=not args.no_bf16,
    )
    spec.validate()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.card_gib and cuda:
        from collector.estimate.fit import limit_of
        from collector.estimate.gpus import card

        total = torch.cuda.get_device_properties(dev).total_memory
        allowed = limit_of(card(f"{args.card_gib}"))
        share = allowed / total
        limits = {"memory_fraction": round(share, 6), "allowed_bytes": allowed, "cuda_total": total}
        torch.cuda.set_per_process_memory_fraction(share, dev)
    probe = None if args.no_probe else StepProbe()
    torch.manual_seed(0)
    with dev:
        model = build.build_model(spec)
    if spec.checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = build.vocab(model)
    out = {"spec": {k: v for k, v in vars(args).items() if k != "config"}, "oom": False}
    if args.card_gib and cuda:
        out.update(limits)
    out["config"] = str(args.config) if args.config else None
    times, peaks = [], []
    try:
        for i in range(1, args.steps + 1):
            t0 = time.perf_counter()
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            with probe.step(i) if probe is not None else _null():
                for _ in range(spec.grad_accum):
                    ids = torch.randint(0, vocab, (spec.batch, spec.seq_len), device=dev)
                    with torch.autocast(dev.type, torch.bfloat16, enabled=spec.bf16):
                        loss = model(input_ids=ids, labels=ids).loss
                    (loss / spec.grad_accum).backward()
                    del loss, ids
                if probe is not None:
                    probe.phase("optimizer")
                opt.step()
                opt.zero_grad(set_to_none=True)
                if cuda:  # read inside the step: the probe resets the peaks when it ends
                    torch.cuda.synchronize(dev)
                    peaks.append(
                        {
                            "allocated_peak": torch.cuda.max_memory_allocated(dev),
                            "reserved_peak": torch.cuda.max_memory_reserved(dev),
                            "reserved_end": torch.cuda.memory_reserved(dev),
                        }
                    )
            times.append(time.perf_counter() - t0)
    except torch.cuda.OutOfMemoryError as exc:
        out["oom"] = True
        out["oom_step"] = len(times) + 1
        out["oom_message"] = str(exc).splitlines()[0][:300]
    finally:
        if probe is not None:
            probe.close()
    out.update(step_times_s=times, steps=peaks, retries=_retries(dev) if cuda else 0)
    out["parameters"] = sum(p.numel() for p in model.parameters())
    print(json.dumps(out))
    return 3 if out["oom"] else 0


def _retries(dev: object) -> int:
    import torch

    return int(torch.cuda.memory_stats(dev).get("num_alloc_retries", 0))


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())

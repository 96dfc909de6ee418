"""Training loops that each show one memory case a report must explain, on a Llama built from a
config with a plain PyTorch loop and the step probe (``probe.watch`` on):

* ``keep_logits`` — every micro-step's logits are kept in a list (gradient accumulation 2):
  a real leak of the logits' size each micro-step (the "I appended the outputs" bug).
* ``shapes`` — every step has another sequence length (random, 128 to ``--seq-len``): the
  caching allocator's blocks of one size do not fit the next; torch reserved grows while the
  live tensors (ledger, allocated peak) stay the same size: fragmentation.
* ``eval`` — every ``--eval-every`` steps, an evaluation pass inside the step (no_grad, a
  batch ``--eval-batch`` large) after the optimizer step: a transient within-step peak that
  the end-of-step reading never shows.
* ``graphs`` — the model under ``torch.compile(mode="reduce-overhead")``: CUDA graphs keep
  their own private memory pool, reserved by the allocator from the first steps on.

    python -m workloads.cases --case keep_logits --size small --steps 8
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any

from collector.model.kinds import Phase
from workloads import add_common_args, finish, script_args

CASES = ("keep_logits", "shapes", "eval", "graphs")
MIB = 1 << 20


def run(args: argparse.Namespace, probe: Any = None) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from collector.estimate.spec import SHAPES

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if args.case == "graphs" and not cuda:
        raise RuntimeError("the graphs case needs a GPU (CUDA graphs)")
    torch.manual_seed(0)
    config = LlamaConfig(
        **SHAPES[args.size], max_position_embeddings=max(args.seq_len, 128), use_cache=False
    )
    with dev:
        model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step_fn = model
    if args.case == "graphs":
        step_fn = torch.compile(model, mode="reduce-overhead")
    if probe is not None:
        probe.watch(model, optimizer)
    vocab = config.vocab_size
    g = torch.Generator().manual_seed(1)
    kept: list[Any] = []
    times: list[float] = []
    lengths: list[int] = []
    for i in range(1, args.steps + 1):
        seq = args.seq_len
        if args.case == "shapes":
            seq = int(torch.randint(128, args.seq_len + 1, (1,), generator=g))
        lengths.append(seq)
        t0 = time.perf_counter()
        with probe.step(i) if probe is not None else contextlib.nullcontext():
            for _ in range(args.grad_accum):
                ids = torch.randint(0, vocab, (args.batch, seq), generator=g).to(dev)
                out = step_fn(input_ids=ids, labels=ids)
                (out.loss / args.grad_accum).backward()
                if args.case == "keep_logits":
                    kept.append(out.logits)  # the bug: every micro-step's logits stay alive
            if probe is not None:
                probe.phase(Phase.OPTIMIZER)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if args.case == "eval" and i % args.eval_every == 0:
                if probe is not None:
                    probe.phase("eval")
                with torch.no_grad():
                    ids = torch.randint(0, vocab, (args.eval_batch, seq), generator=g).to(dev)
                    model(input_ids=ids, labels=ids).loss.item()
            if cuda:
                torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if args.pause_ms:
            time.sleep(args.pause_ms / 1000)
    return {
        "workload": f"cases:{args.case}",
        "case": args.case,
        "size": args.size,
        "steps": len(times),
        "seq_lens": lengths,
        "kept_tensors": len(kept),
        "step_times_s": times,
    }


def parser() -> argparse.ArgumentParser:
    from collector.estimate.spec import SHAPES

    p = argparse.ArgumentParser(prog="cases", description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=CASES, required=True)
    p.add_argument("--size", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512, help="tokens (shapes: the longest)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=3, help="eval: every this many steps")
    p.add_argument("--eval-batch", type=int, default=16, help="eval: its batch")
    add_common_args(p)
    return p


def check(args: argparse.Namespace) -> None:
    for name in ("steps", "seq_len", "batch", "grad_accum", "eval_every", "eval_batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.case == "shapes" and args.seq_len < 128:
        raise ValueError("--seq-len must be >= 128 for the shapes case")


def main(argv: list[str] | None = None) -> int:
    _, args = script_args(sys.modules[__name__], argv)
    from collector.probe.core import StepProbe

    probe = None if args.no_probe else StepProbe()
    return finish(run(args, probe), probe, args.summary)


if __name__ == "__main__":
    sys.exit(main())

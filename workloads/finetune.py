"""The seed scenario: a full fine-tune of a Llama built from a config, under the HF Trainer.

fp32 weights with bf16 autocast, gradient checkpointing, batch 1, gradient accumulation 2,
synthetic tokens, an optimizer chosen with ``--optim`` (``adamw_8bit`` and ``paged_adamw_8bit``
are bitsandbytes'; ``adamw_torch`` is PyTorch's). No weights are downloaded: the model is built
from :data:`collector.estimate.spec.SHAPES` (the shapes the estimate knows too) and initialised
randomly (memory behaviour does not depend on the values).

    python -m workloads.finetune --size 7b --optim adamw_8bit --steps 4     # on a GPU
    python -m workloads.finetune --size tiny --steps 3                      # anywhere
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from collector.estimate.spec import OPTIMS, SHAPES, Spec


def build_model(size: str, seq_len: int, device_map: str | None) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **SHAPES[size],
        max_position_embeddings=max(seq_len, 128),
        use_cache=False,
    )
    if device_map == "auto" and torch.cuda.device_count() > 1:
        from accelerate import dispatch_model, infer_auto_device_map

        model = LlamaForCausalLM(config)
        dmap = infer_auto_device_map(model, no_split_module_classes=["LlamaDecoderLayer"])
        return dispatch_model(model, dmap)
    if torch.cuda.is_available():
        with torch.device("cuda"):  # build on the GPU: a 7B random init on the CPU takes minutes
            return LlamaForCausalLM(config)
    return LlamaForCausalLM(config)


class SyntheticTokens:
    """Random token ids of one fixed length (labels = inputs, as in causal LM fine-tuning)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _StepTimer:
    """Wall time of each optimizer step (host side, synchronised at step end)."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        timer = self

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                timer.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                import torch

                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                timer.times.append(time.perf_counter() - timer.t0)

        self.t0 = 0.0
        self.times: list[float] = []
        self.callback = _CB()


def run(args: argparse.Namespace, probe: Any = None) -> dict[str, Any]:
    """Train ``args.steps`` optimizer steps; returns a summary (step times, losses, config)."""
    import torch
    from transformers import Trainer, TrainingArguments

    from collector.probe.hf import attach

    cuda = torch.cuda.is_available()
    if args.optim != "adamw_torch" and not cuda:
        raise SystemExit(
            f"finetune: --optim {args.optim} needs CUDA (bitsandbytes); "
            "use --optim adamw_torch on a machine without a GPU"
        )
    torch.manual_seed(0)
    model = build_model(args.size, args.seq_len, args.device_map)
    samples = args.steps * args.grad_accum * args.batch
    data = SyntheticTokens(samples, args.seq_len, SHAPES[args.size]["vocab_size"])
    timer = _StepTimer()
    callbacks: list[Any] = [timer.callback]
    with tempfile.TemporaryDirectory(prefix="stepmem-finetune-") as out:
        targs = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=args.grad_accum,
            max_steps=args.steps,
            learning_rate=1e-5,
            bf16=cuda,
            gradient_checkpointing=True,
            optim=args.optim,
            logging_steps=1,
            save_strategy="no",
            report_to=list(getattr(args, "report_to", None) or []),
            dataloader_num_workers=0,
            use_cpu=not cuda,
            disable_tqdm=True,
            seed=0,
        )
        trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks)
        if probe is not None:  # ahead of the reporting callbacks: its keys reach the trackers
            attach(trainer, probe, watch=not getattr(args, "no_watch", False))
        result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "workload": "finetune",
        "size": args.size,
        "optim": args.optim,
        "steps": args.steps,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "grad_accum": args.grad_accum,
        "device_map": args.device_map,
        "step_times_s": timer.times,
        "losses": losses,
        "train_runtime_s": result.metrics.get("train_runtime"),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def parser() -> argparse.ArgumentParser:
    from collector.args import positive_int

    p = argparse.ArgumentParser(prog="finetune", description=__doc__.splitlines()[0])
    p.add_argument(
        "--size",
        choices=sorted(SHAPES),
        default=None,
        help="model shape (default: 7b on a GPU, tiny elsewhere)",
    )
    p.add_argument(
        "--optim",
        choices=OPTIMS,
        default=None,
        help="optimizer (default: adamw_8bit on a GPU, adamw_torch elsewhere)",
    )
    p.add_argument("--steps", type=positive_int, default=4, help="optimizer steps (default 4)")
    p.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        help="tokens per sequence (default: 4096 on a GPU, 64 elsewhere)",
    )
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--grad-accum", type=positive_int, default=2)
    p.add_argument(
        "--device-map",
        choices=("auto", "none"),
        default="none",
        help="'auto' spreads the model over every visible GPU (accelerate)",
    )
    p.add_argument("--no-probe", action="store_true", help="run without stepmem's probe")
    p.add_argument(
        "--no-watch",
        action="store_true",
        help="the probe without the model and optimizer: no ledger (a probe that never calls "
        "watch())",
    )
    p.add_argument(
        "--report-to",
        nargs="+",
        default=[],
        metavar="TRACKER",
        help="the Trainer's report_to (tensorboard, mlflow, wandb…): the stepmem/* keys go there "
        "on the training-step axis (default: none)",
    )
    p.add_argument("--summary", type=Path, help="write the run summary (JSON) here")
    return p


def defaults(args: argparse.Namespace) -> argparse.Namespace:
    """What depends on the machine (:meth:`Spec.for_machine`: the 7B ``adamw_8bit`` fine-tune
    at 4,096 tokens on a GPU, the tiny shape elsewhere), filled in where not given."""
    import torch

    machine = Spec.for_machine(torch.cuda.is_available())
    args.size = args.size or machine.size
    args.optim = args.optim or machine.optim
    args.seq_len = args.seq_len or machine.seq_len
    args.device_map = None if args.device_map == "none" else args.device_map
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = defaults(parser().parse_args(argv))
    from collector.probe.core import StepProbe

    probe = None if args.no_probe else StepProbe()
    summary = run(args, probe)
    if probe is not None:
        summary["probe_cost_ns"] = probe.cost_ns
        summary["probe_devices"] = [str(d) for d in probe.devices]
    text = json.dumps(summary, indent=1)
    if args.summary:
        args.summary.write_text(text)
    print(text, file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

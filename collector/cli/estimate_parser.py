"""``stepmem estimate``'s parser: what is estimated (a built-in size, a config, a run's model,
your script), the training it does, LoRA and QLoRA, the card it is held against and the search,
and where the estimate goes. Each flag is a field of
:class:`collector.estimate.request.EstimateFlags` (a test holds the two together); its default
and its check are :func:`collector.estimate.request.plan_estimate`'s."""

from __future__ import annotations

import argparse
from pathlib import Path

from collector import args

__all__ = ["estimate_parser"]


ESTIMATE_EPILOG = """\
modelled:
  parameters, buffers, gradients, optimizer state (8-bit and paged included), activations and
  temporaries per module; CUDA autocast's casts and the attention kernel CUDA picks (also
  without a GPU); the caching allocator (rounding, pools, best fit, splits, max_split_size_mb,
  roundup_power2_divisions, garbage_collection_threshold, expandable_segments, a second
  stream's pool, retries and out of memory); FSDP2 shards, one rank; NVML = reserved + the
  process's memory outside torch (measured per GPU model; devices --calibrate for yours) +
  paged optimizer state. LoRA adapters and bitsandbytes 4-bit bases (--lora-r, --load-in-4bit,
  or a script's own).
your own script:
  stepmem estimate --script train.py --out est.json -- --its --args
  runs it unchanged on fake tensors to the end of its second probe step (exit 1: stopped early,
  the steps before printed; exit 2: no step traced). A script that reads values of tensors
  (.item(), int(i), bool(t): answered with placeholders) runs a second time with other
  placeholders; exit 4: they changed the figures (printed, with the line that read the value,
  and no verdict on fitting). --max-batch --batch-arg NAME: the largest value of the script's
  own option NAME that fits, the script traced at each size.
make it fit:
  stepmem estimate --size 7b --gpu 24 --plan [--keep optim,lora]
  the changes that make the step fit, each traced and printed as the command that checks it:
  the same training first (micro-batches, checkpointing, expandable segments, FSDP2), then 8-bit
  optimizers, LoRA, QLoRA, shorter sequences (exit 3: none fits).
not modelled:
  other processes on the GPU; kernels' internal workspaces other than cuBLAS's (cuDNN, NCCL's
  buffers beyond the calibrated figure); CUDA graphs; data-dependent shapes (the trace stops
  there and says where); host memory.
"""


def _fit_flags(e) -> None:
    """``stepmem estimate``'s "will it fit" flags: the GPU, the allocator, the search."""
    from collector.estimate.gpus import GPUS
    from collector.estimate.largest import SEQ_STEP

    fit = e.add_argument_group(
        "will it fit",
        "what the GPU will hold: torch's reserved bytes from a model of its caching allocator, "
        "and NVML's figure (reserved + this process's memory outside torch, measured per GPU "
        "model: stepmem devices --calibrate)",
    )
    fit.add_argument(
        "--gpu",
        metavar="NAME|GIB",
        help="hold the step against this GPU: one of "
        f"{', '.join(GPUS)}, or a size in GiB (default: this machine's GPU, if it has one)",
    )
    fit.add_argument(
        "--alloc-conf",
        metavar="CONF",
        help="the caching allocator's settings as PYTORCH_CUDA_ALLOC_CONF writes them "
        "(default: that variable's, else PYTORCH_ALLOC_CONF's, else torch's defaults)",
    )
    fit.add_argument(
        "--memory-fraction",
        type=float,
        metavar="F",
        help="the share of the GPU torch may use, as torch.cuda.set_per_process_memory_fraction",
    )
    fit.add_argument(
        "--margin",
        type=float,
        metavar="PCT",
        help="percent of what torch may reserve kept free when judging a fit (default 2, up to 50)",
    )
    _plan_flags(fit)
    search = fit.add_mutually_exclusive_group()
    search.add_argument(
        "--max-batch",
        action="store_true",
        help="find the largest micro-batch that fits (traces a few sizes: seconds to minutes)",
    )
    search.add_argument(
        "--max-seq-len",
        action="store_true",
        help=f"find the longest sequence that fits, in steps of {SEQ_STEP} tokens",
    )


def _plan_flags(fit) -> None:
    """``--plan``: changes that make the step fit, each traced."""
    from collector.model.plans import KNOBS

    fit.add_argument(
        "--plan",
        action="store_true",
        help="list changes that make the step fit this GPU, each traced and printed as the "
        "command that checks it, the same training first (a few more traces: minutes for a 7B)",
    )
    fit.add_argument(
        "--keep",
        metavar="KNOBS",
        help="--plan: comma-separated settings no plan may change, of "
        f"{', '.join(KNOBS)}, optim (both 8-bit optimizers), lora (LoRA and QLoRA)",
    )


def _lora_flags(e) -> None:
    """LoRA and QLoRA for a model named by --size/--config."""
    e.add_argument(
        "--lora-r",
        type=args.positive_int,
        metavar="R",
        help="train peft LoRA adapters of rank R on a frozen base (their gradients and optimizer "
        "state only)",
    )
    e.add_argument(
        "--lora-targets",
        metavar="NAMES",
        help="comma-separated modules LoRA adapts (default: every projection, q_proj,k_proj,"
        "v_proj,o_proj,gate_proj,up_proj,down_proj)",
    )
    e.add_argument(
        "--load-in-4bit",
        action="store_true",
        help="QLoRA's base: bitsandbytes NF4 with double quantisation, bf16 compute (with "
        "--lora-r)",
    )


def _script_flags(e, model) -> None:
    """``stepmem estimate --script``'s flags (``model``: the group of ways to name a model)."""
    model.add_argument(
        "--script",
        type=Path,
        metavar="TRAIN.py",
        help="your own training script, unchanged (with the probe's lines or callback), run on "
        "fake tensors through its first two probe steps; its arguments go after '--'",
    )
    e.add_argument(
        "--time-limit",
        type=args.positive_float,
        default=None,
        metavar="SECONDS",
        help="stop a trace that has not ended by then: a script's run to its second probe step, "
        "or one trace of a config or size (default 900; a --max-* search traces several)",
    )
    e.add_argument(
        "--batch-arg",
        metavar="NAME",
        help="--max-batch of a script: the script's own option for its micro-batch "
        "(e.g. per_device_train_batch_size), set to each size the search traces",
    )
    e.add_argument(
        "--seq-len-arg",
        metavar="NAME",
        help="--max-seq-len of a script: the script's own option for its sequence length",
    )


def _estimate_output_flags(e) -> None:
    """Where the estimate goes: ``--out`` (and ``--force``), ``--json``."""
    e.add_argument("--out", help="write the estimate (JSON) here, for report --estimate")
    e.add_argument(
        "--force",
        action="store_true",
        help="let --out overwrite an existing file that is not a stepmem estimate",
    )
    e.add_argument("--json", action="store_true", help="print the estimate as JSON")


def _workload_flags(e, workloads, shards) -> None:
    """The loop traced, and FSDP2's ranks."""
    e.add_argument(
        "--workload",
        choices=workloads,
        help="finetune: the HF Trainer's step (bf16 autocast, gradient checkpointing, "
        "gradients freed after the step); distributed: workloads/distributed.py's plain loop "
        "(fp32, gradients kept, FSDP2 by default). Default finetune",
    )
    e.add_argument(
        "--shard",
        choices=shards,
        help="fully_shard every decoder layer and the root (default: fsdp2 for distributed, "
        "none for finetune)",
    )
    e.add_argument(
        "--world-size",
        type=args.positive_int,
        metavar="N",
        help="ranks the model is sharded over; one rank is estimated (default 1)",
    )


def estimate_parser(sub) -> None:
    from collector.estimate.spec import OPTIMS, SHAPES, SHARDS, WORKLOADS

    e = sub.add_parser(
        "estimate",
        help="predict a step's memory per component and module before it runs (no GPU memory)",
        description="Predict a training step's GPU memory before it runs, and whether it fits: "
        "the model is built and trained for two steps on fake tensors (no memory used, the same "
        "on a machine without a GPU), torch's tracker files every tensor, and the storages' "
        "creations and releases are played through a model of PyTorch's caching allocator.",
        epilog=ESTIMATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _workload_flags(e, WORKLOADS, SHARDS)
    model = e.add_mutually_exclusive_group()
    model.add_argument(
        "--size",
        choices=sorted(SHAPES),
        help="the finetune workload's Llama shape (default: 7b on a GPU, tiny elsewhere)",
    )
    model.add_argument(
        "--config",
        type=Path,
        metavar="CONFIG.json",
        help="a Hugging Face config.json (or the folder holding it): any causal LM "
        "transformers builds from a config; read as data, no code from it is run",
    )
    model.add_argument(
        "--like",
        type=Path,
        metavar="RUN",
        help="the model, optimizer and batch of a stored finetune run (its workload summary)",
    )

    e.add_argument("--optim", choices=OPTIMS, help="default: adamw_8bit on a GPU, else adamw_torch")
    e.add_argument(
        "--seq-len",
        type=args.positive_int,
        help="tokens per sequence (default: 4096 on a GPU, 64 elsewhere)",
    )
    e.add_argument("--batch", type=args.positive_int, help="sequences a micro-batch (default 1)")
    e.add_argument(
        "--grad-accum",
        type=args.positive_int,
        help="micro-batches a step (default: 2 for finetune, 1 for distributed)",
    )
    e.add_argument("--no-checkpointing", action="store_true", help="without gradient checkpointing")
    _lora_flags(e)
    e.add_argument("--fp32", action="store_true", help="without bf16 autocast")
    _script_flags(e, model)
    _fit_flags(e)
    _estimate_output_flags(e)
    e.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="after '--': arguments for --script"
    )

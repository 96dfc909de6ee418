"""What is estimated: a model (a built-in Llama shape or a Hugging Face config), an optimizer, a
batch and the loop around them (:class:`Spec`), with the defaults a machine implies and the
shapes and optimizers stepmem knows — which the ``finetune`` workload trains, too."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from collector.model.errors import EstimateError
from collector.model.untrusted import inert, read_json

__all__ = ["OPTIMS", "SHAPES", "SHARDS", "WORKLOADS", "Spec", "read_config"]

OPTIMS = ("adamw_8bit", "paged_adamw_8bit", "adamw_torch")
SHARDS = ("none", "fsdp2")
WORKLOADS = ("finetune", "distributed")  # the loops an estimate traces
SHAPES: dict[str, dict[str, int]] = {
    # Llama-2-7B
    "7b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=11008,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    ),
    # ~3.4B (OpenLLaMA 3B's shape): a full fine-tune with PyTorch's AdamW on one GPU
    "3b": dict(
        hidden_size=3200,
        num_hidden_layers=26,
        intermediate_size=8640,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    ),
    # ~1.1B (TinyLlama's shape): the distributed runs on one GPU
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=22,
        intermediate_size=5632,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    # ~0.2B: quick GPU checks
    "small": dict(
        hidden_size=1024,
        num_hidden_layers=8,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
    ),
    # CPU tests
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=512,
    ),
}
MAX_WORLD = 1 << 16
MAX_SEQ = 1 << 20
MAX_ACCUM = 4096  # micro-batches a step
MAX_LORA_R = 4096
MAX_CONFIG_BYTES = 1 << 20  # a model's config.json is a few KiB


@dataclass(frozen=True)
class Spec:
    """What is estimated: a Llama shape or a Hugging Face config, an optimizer, a batch."""

    workload: str = "finetune"
    size: str | None = "tiny"
    config: dict[str, Any] | None = None  # a Hugging Face config (model_type and its fields)
    optim: str = "adamw_torch"
    seq_len: int = 64
    batch: int = 1
    grad_accum: int = 2
    checkpointing: bool = True
    bf16: bool = True
    shard: str = "none"  # "fsdp2": every decoder layer and the root fully_shard-ed
    world_size: int = 1  # ranks the model is sharded over (one rank is estimated)
    keep_grads: bool = False  # zero_grad(set_to_none=False): gradients stay between steps
    lora_r: int = 0  # peft LoRA adapters of this rank (0: none; the base trains)
    lora_targets: tuple[str, ...] = ()  # the modules adapted (empty: every projection)
    load_in_4bit: bool = False  # bitsandbytes NF4 base with double quantisation (QLoRA)

    @classmethod
    def for_machine(cls, gpu: bool, workload: str = "finetune", **given: Any) -> Spec:
        """A spec for this machine: what ``given`` names (None: not given), the rest by
        default — the seed's 7B ``adamw_8bit`` fine-tune at 4,096 tokens on a GPU, the tiny
        shape with ``adamw_torch`` at 64 tokens elsewhere (the ``finetune`` workload's own
        defaults); ``distributed`` is workloads/distributed.py's loop (FSDP2 by default, fp32,
        gradients kept, no checkpointing, one micro-batch)."""
        given = {k: v for k, v in given.items() if v is not None}
        dist = workload == "distributed"
        big = gpu and not dist
        fields: dict[str, Any] = {
            "workload": workload,
            "optim": "adamw_8bit" if big else "adamw_torch",
            "seq_len": 4096 if big else 64,
            "grad_accum": 1 if dist else 2,
        }
        if dist:
            fields.update(
                shard="fsdp2", keep_grads=True, bf16=False, checkpointing=False, world_size=1
            )
        if given.get("config") is not None:
            fields["size"] = None
        else:
            fields["size"] = "7b" if big else "tiny"
        fields.update(given)
        return cls(**fields)

    def like(self, summary: Any, source: str) -> Spec:
        """This spec with the model, optimizer and batch of a stored ``finetune`` run's workload
        summary (data, checked field by field); :class:`EstimateError` naming ``source``
        otherwise."""
        if not isinstance(summary, dict) or summary.get("workload") != "finetune":
            what = (
                f"a run of the {str(summary.get('workload'))[:40]!r} workload"
                if isinstance(summary, dict) and summary.get("workload")
                else "a run without a workload summary (a replay of a capture, or a script)"
            )
            raise EstimateError(
                f"--like {source}: {what}; --like takes the model, optimizer and batch of a "
                "finetune run (stepmem run --workload finetune on a GPU, e.g. "
                "benchmarks/results/h200-jobs/runs/h200-7b-adamw); otherwise name them "
                "(--size/--config, --optim, --seq-len, --batch)"
            )
        out: dict[str, Any] = {}
        for key, kind in (("size", str), ("optim", str), ("seq_len", int), ("batch", int)):
            v = summary.get(key)
            if not isinstance(v, kind) or isinstance(v, bool):
                raise EstimateError(f"--like {source}: its summary has no {key}")
            out[key] = v
        ga = summary.get("grad_accum", 2)
        out["grad_accum"] = ga if isinstance(ga, int) and not isinstance(ga, bool) else 2
        return replace(self, config=None, **out)

    def validate(self) -> None:
        if self.workload not in WORKLOADS:
            raise EstimateError(f"workload {self.workload!r}: one of {', '.join(WORKLOADS)}")
        if self.optim not in OPTIMS:
            raise EstimateError(f"optimizer {self.optim!r}: one of {', '.join(OPTIMS)}")
        if self.shard not in SHARDS:
            raise EstimateError(f"shard {self.shard!r}: one of {', '.join(SHARDS)}")
        w = self.world_size
        if not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= MAX_WORLD:
            raise EstimateError(f"world size must be a whole number from 1 to {MAX_WORLD}")
        if self.shard == "fsdp2" and self.optim != "adamw_torch":
            raise EstimateError(
                "bitsandbytes' optimizers under FSDP2 are not modelled: estimate with adamw_torch"
            )
        for name, top in (("seq_len", MAX_SEQ), ("batch", MAX_SEQ), ("grad_accum", MAX_ACCUM)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= top:
                raise EstimateError(f"{name} must be a whole number from 1 to {top:,}")
        r = self.lora_r
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r <= MAX_LORA_R:
            raise EstimateError(f"lora_r must be a whole number from 0 to {MAX_LORA_R}")
        if (self.lora_r or self.load_in_4bit) and self.shard != "none":
            raise EstimateError("LoRA and 4-bit bases under FSDP2 are not modelled")
        if self.lora_targets and not self.lora_r:
            raise EstimateError("--lora-targets needs --lora-r")
        if self.config is None and self.size is None:
            raise EstimateError("a model: a built-in size or a Hugging Face config")
        if self.config is None and self.size not in SHAPES:
            raise EstimateError(f"size {self.size!r}: one of {', '.join(sorted(SHAPES))}")


def read_config(path: Path) -> dict[str, Any]:
    """A Hugging Face ``config.json`` (or the folder holding it) as data: a regular file of JSON
    of at most :data:`MAX_CONFIG_BYTES` with a ``model_type``. A config is shapes: one whose
    model is custom code (``auto_map``), whose attention is anything but torch's own kernels (a
    name the ``kernels`` library would fetch from the Hub), or that names a pretrained backbone
    to download is refused; so is a model too large to trace (:func:`check_shapes`). stepmem
    runs no code from a config and nothing in it reaches the network."""
    f = path / "config.json" if path.is_dir() else path
    try:
        cfg = read_json(f, MAX_CONFIG_BYTES, f"--config {f}")
    except OSError as exc:
        raise EstimateError(f"--config {f}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise EstimateError(str(exc)) from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        raise EstimateError(f"--config {f}: a config.json with a model_type")
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", cfg["model_type"]):
        raise EstimateError(
            f"--config {f}: model_type {inert(cfg['model_type'])[:64]!r} is not a model type "
            "(letters, digits, '_', '-' and '.')"
        )
    if cfg.get("auto_map"):
        raise EstimateError(
            f"--config {f}: its model is custom code (auto_map); stepmem runs no code from a config"
        )
    check_shapes(cfg, f"--config {f}")
    return cfg


ATTENTION = ("eager", "sdpa")  # the attention implementations torch itself ships
_FETCHING = ("backbone", "use_pretrained_backbone", "use_timm_backbone")
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_WIDTH_KEYS = ("hidden_size", "n_embd", "d_model", "intermediate_size", "vocab_size")
MAX_LAYERS = 1024  # the deepest released models have a few hundred
MAX_EXPERTS = 1024
MAX_WIDTH = 1 << 22


def check_shapes(cfg: dict[str, Any], where: str) -> None:
    """:class:`EstimateError` for what in a config (or a sub-config) would reach the network
    or could not be traced in bounded time: an attention implementation other than
    :data:`ATTENTION`, a backbone to fetch, more than :data:`MAX_LAYERS` layers or
    :data:`MAX_EXPERTS` experts, a width over :data:`MAX_WIDTH`."""
    todo = [cfg]
    while todo:
        c = todo.pop()
        for k, v in c.items():
            if isinstance(v, dict):
                todo.append(v)
            elif k in ("attn_implementation", "_attn_implementation") and v is not None:
                if v not in ATTENTION:
                    raise EstimateError(
                        f"{where}: {k} {str(v)[:80]!r}: one of {', '.join(ATTENTION)} (a config "
                        "is shapes; stepmem loads no kernel named by it)"
                    )
            elif k in _FETCHING and v:
                raise EstimateError(
                    f"{where}: {k}: a pretrained backbone is fetched from the network; stepmem "
                    "reads no weights and fetches nothing for an estimate"
                )
            elif k in _LAYER_KEYS + _EXPERT_KEYS + _WIDTH_KEYS and not isinstance(v, bool):
                top = (
                    MAX_LAYERS
                    if k in _LAYER_KEYS
                    else MAX_EXPERTS
                    if k in _EXPERT_KEYS
                    else MAX_WIDTH
                )
                if isinstance(v, int) and not 0 <= v <= top:
                    raise EstimateError(f"{where}: {k} {v}: at most {top:,} for an estimate")

"""LoRA and QLoRA for a model given as a config (``stepmem estimate --config … --lora-r 16
--load-in-4bit``), built the way the QLoRA recipe builds it:

* ``--load-in-4bit``: every linear layer but the output head becomes bitsandbytes'
  ``Linear4bit`` (NF4, double quantisation, bf16 compute — ``BitsAndBytesConfig(load_in_4bit=True,
  bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)``), quantised by bitsandbytes' own
  code (its fake kernels lay out the packed weight, absmax and nested state); then peft's
  ``prepare_model_for_kbit_training`` (the other parameters in float32, the base frozen);
* ``--lora-r R`` (``--lora-targets``, default every projection): peft's LoRA adapters, whose
  parameters alone train — their gradients and optimizer state, and the frozen base's
  activations kept for the adapters' backward, are what the trace then sees.

A script gets the same by simply running (``stepmem estimate --script``).
"""

from __future__ import annotations

from typing import Any

from collector.model.errors import EstimateError

__all__ = ["DEFAULT_TARGETS", "adapt"]

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HEAD = "lm_head"


def import_bitsandbytes() -> Any:
    """bitsandbytes, imported without its CPU kernels' warnings about a hub it may not reach (on
    the CPU that traces, not the user's GPU: the estimate does not use those kernels); None when
    it is not installed."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    import contextlib
    import io
    import logging

    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            import bitsandbytes
    finally:
        logging.disable(logging.NOTSET)
    return bitsandbytes


def _quantise_4bit(model: Any, device: Any) -> None:
    """Every ``nn.Linear`` but the head as a 4-bit ``Linear4bit``, quantised on ``device``."""
    import torch

    bnb = import_bitsandbytes()
    if bnb is None:
        raise EstimateError("--load-in-4bit needs bitsandbytes: pip install bitsandbytes")
    # bitsandbytes caches its dynamic map per process: one made under an earlier trace's fake
    # mode cannot meet this one's tensors
    getattr(bnb.functional, "name2qmap", {}).clear()
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear or child_name == HEAD:
                continue
            q = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=torch.bfloat16,
                compress_statistics=True,
                quant_type="nf4",
                device="meta",
            )
            w = child.weight  # built on the meta device: loaded now, in bf16, one at a time
            loaded = torch.empty(w.shape, dtype=torch.bfloat16, device=device) if w.is_meta else w
            q.weight = bnb.nn.Params4bit(
                loaded.data.to(torch.bfloat16),
                requires_grad=False,
                compress_statistics=True,
                quant_type="nf4",
                module=q,
            )
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            q.weight.to(device)  # bitsandbytes quantises in place (Params4bit._quantize)
            setattr(module, child_name, q)
            del child, w, loaded
    model.is_loaded_in_4bit = True


def _load_bf16(model: Any, device: Any) -> None:
    """A base built on the meta device loaded as ``from_pretrained(…, load_in_4bit=True)``
    loads it: every parameter and buffer on ``device``, floating ones in bf16 (the recipe's
    ``torch_dtype``), but the linear layers' weights, which :func:`_quantise_4bit` loads one at
    a time and quantises — the GPU never holds the full-precision model. Tied parameters stay
    tied. (A base built on the device is cast in place, as before.)"""
    import torch

    quantised = {
        id(child.weight)
        for m in model.modules()
        for name, child in m.named_children()
        if type(child) is torch.nn.Linear and name != HEAD
    }
    made: dict[int, Any] = {}
    for m in model.modules():
        for kind in ("_parameters", "_buffers"):
            tensors = getattr(m, kind)
            for name, t in list(tensors.items()):
                if t is None or id(t) in quantised:
                    continue
                dtype = torch.bfloat16 if t.is_floating_point() else t.dtype
                if not t.is_meta:
                    t.data = t.data.to(dtype)
                    continue
                if id(t) not in made:
                    new = torch.empty(t.shape, dtype=dtype, device=device)
                    made[id(t)] = (
                        torch.nn.Parameter(new, requires_grad=t.requires_grad)
                        if kind == "_parameters"
                        else new
                    )
                tensors[name] = made[id(t)]


def adapt(model: Any, device: Any, lora_r: int, targets: tuple[str, ...], in_4bit: bool) -> Any:
    """``model`` quantised to 4 bits and/or given LoRA adapters (see the module doc)."""
    if in_4bit:
        _load_bf16(model, device)
        _quantise_4bit(model, device)
    if not lora_r:
        return model
    try:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    except ImportError:
        raise EstimateError("--lora-r needs peft (pip install peft)") from None
    if in_4bit:  # the rest in float32, the base frozen; checkpointing is the trace's to set
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        for p in model.parameters():
            p.requires_grad_(False)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in present]
    if missing:
        raise EstimateError(
            f"--lora-targets: the model has no module named {', '.join(missing)} (its linear "
            f"layers: {', '.join(sorted(n for n in present if n.endswith('proj'))) or 'none'})"
        )
    config = LoraConfig(
        r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.05, target_modules=list(targets)
    )
    model = get_peft_model(model, config)
    # a checkpointed block of a frozen base has inputs that need no gradient: the recipe makes
    # the embeddings' output need one, or the adapters inside get none
    model.enable_input_require_grads()
    return model

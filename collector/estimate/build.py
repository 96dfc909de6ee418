"""What an estimate traces, built on the fake device: the model (a built-in shape or a Hugging
Face config, read as data), its optimizer (AdamW, or a stand-in with bitsandbytes' 8-bit state
layout) and FSDP2 over a fake process group. Nothing here allocates device memory: it runs
inside the trace's ``FakeTensorMode``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

from collector.estimate.spec import SHAPES, Spec
from collector.model.errors import EstimateError
from collector.model.kinds import ESTIMATE_KINDS, MemoryKind
from collector.model.untrusted import inert

__all__ = [
    "build_model",
    "fake_group",
    "group_closed",
    "layers",
    "optimizer",
    "static_parts",
    "vocab",
]

BNB_MIN_8BIT = 4096  # bitsandbytes: tensors with fewer elements keep float32 state
BNB_BLOCK = 256  # bitsandbytes: one float32 absmax per block of this many elements
BNB_PAGED_MIN = 100_000  # bitsandbytes: tensors at least this large get paged state
BNB_QMAP = 256 * 4 * 2  # the two shared quantisation maps (256 float32 each)


OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def offline() -> None:
    """The Hub off for this process: a config is shapes, and nothing in it (a kernel's name, a
    backbone) may reach the network. Set before transformers and huggingface_hub read their
    settings, and in their settings when they already have."""
    import os
    import sys

    os.environ.update(OFFLINE)
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:
        hub.HF_HUB_OFFLINE = True


def build_model(spec: Spec, device: Any = None) -> Any:
    """``spec``'s model (a Hugging Face config's, or a built-in Llama shape), with the Hub
    off (:func:`offline`); a 4-bit base and LoRA adapters as ``spec`` asks
    (:mod:`collector.estimate.lora`)."""
    if spec.load_in_4bit:  # as from_pretrained quantises: no full-precision model on the GPU
        import torch

        with torch.device("meta"):
            model = _base_model(spec)
    else:
        model = _base_model(spec)
    if spec.lora_r or spec.load_in_4bit:
        from collector.estimate.lora import DEFAULT_TARGETS, adapt

        targets = tuple(spec.lora_targets) or DEFAULT_TARGETS
        model = adapt(model, device, spec.lora_r, targets, spec.load_in_4bit)
    return model


def _why(exc: BaseException) -> str:
    """A library's error about a config, as one inert line (the config's own strings are in it)."""
    return inert(" ".join(str(exc).split()))[:300]


def _base_model(spec: Spec) -> Any:
    offline()
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if spec.config is not None:
        cfg = dict(spec.config)
        kind = cfg.pop("model_type", None)
        if not isinstance(kind, str):
            raise EstimateError("the config needs its model_type (as config.json has it)")
        try:  # the config is data; whatever transformers refuses in it is the user's to fix
            config = AutoConfig.for_model(kind, **cfg)
        except Exception as exc:
            raise EstimateError(
                f"config: transformers could not build its config ({_why(exc)})"
            ) from None
        config.use_cache = False
        try:
            return AutoModelForCausalLM.from_config(config)
        except EstimateError:
            raise  # a bound the build met (collector.estimate.limits)
        except Exception as exc:
            raise EstimateError(
                f"config: transformers could not build its model ({_why(exc)})"
            ) from None
    if spec.size not in SHAPES:
        raise EstimateError(f"size {spec.size!r}: one of {', '.join(sorted(SHAPES))}")
    config = LlamaConfig(
        **SHAPES[spec.size], max_position_embeddings=max(spec.seq_len, 128), use_cache=False
    )
    return LlamaForCausalLM(config)


def _bnb_stand_in(params_and_embedding: list[tuple[Any, bool]], paged: bool) -> Any:
    """An optimizer whose state has bitsandbytes' 8-bit AdamW layout (see the module doc); its
    step updates nothing (the real update is one fused kernel without temporaries)."""
    import torch

    class BnbStateLayout(torch.optim.Optimizer):
        def __init__(self) -> None:
            super().__init__([p for p, _ in params_and_embedding], {"lr": 0.0})
            self.embedding = {id(p) for p, emb in params_and_embedding if emb}
            self.managed = 0
            self.qmap: Any = None

        @torch.no_grad()
        def step(self, closure: Callable[[], Any] | None = None) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None or self.state[p]:
                        continue
                    st = self.state[p]
                    st["step"] = 0  # a Python int in bitsandbytes' state
                    n = p.numel()
                    eight = n >= BNB_MIN_8BIT and id(p) not in self.embedding
                    dtype = torch.uint8 if eight else torch.float32
                    for key in ("state1", "state2"):
                        if paged and n >= BNB_PAGED_MIN:  # managed memory, outside the pool
                            self.managed += n * (1 if eight else 4)
                        else:
                            st[key] = torch.zeros_like(p, dtype=dtype)
                    if eight:
                        if self.qmap is None:
                            self.qmap = torch.zeros(BNB_QMAP // 4, device=p.device)
                        st["qmap"] = self.qmap
                        blocks = math.ceil(n / BNB_BLOCK)
                        st["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                        st["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)

    return BnbStateLayout()


def optimizer(spec: Spec, model: Any) -> Any:
    """``spec``'s optimizer over ``model``'s parameters."""
    import torch

    if spec.optim == "adamw_torch":
        # foreach=True: CUDA's default (the CPU's is False); its temporaries are what a GPU sees
        return torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    embedding = {
        id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)
    }  # the HF Trainer registers 32-bit state for these (GlobalOptimManager override)
    params = [(p, id(p) in embedding) for p in model.parameters() if p.requires_grad]
    return _bnb_stand_in(params, paged=spec.optim == "paged_adamw_8bit")


def static_parts(model: Any, opt: Any, spec: Spec) -> dict[str, int]:
    """Parameters, gradients and optimizer state from shapes alone (an untraceable model)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if spec.optim == "adamw_torch":
        state = sum(2 * p.numel() * p.element_size() for p in model.parameters())
    else:
        state = 0
        for p in model.parameters():
            n = p.numel()
            state += 2 * n if n >= BNB_MIN_8BIT else 8 * n
            state += 8 * math.ceil(n / BNB_BLOCK) if n >= BNB_MIN_8BIT else 0
    out = dict.fromkeys(ESTIMATE_KINDS, 0)
    out[MemoryKind.PARAMETERS] = params
    out[MemoryKind.GRADIENTS] = grads
    out[MemoryKind.OPTIMIZER_STATE] = state
    return out


@contextlib.contextmanager
def unpacked_inputs() -> Any:
    """Transformers' packed-sequence check, answered as the real step answers it for the
    trace's inputs (one sequence per row, positions 0…n−1): not packed. Under fake tensors it
    cannot read the positions, takes the inputs for packed, and builds a full attention mask
    that keeps every kernel but the math and memory-efficient ones out — which the real step,
    passing ``is_causal`` and no mask, never does."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    real = getattr(masking_utils, "find_packed_sequence_indices", None)
    if real is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda *a, **k: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = real


@contextlib.contextmanager
def own_propagation_mode() -> Any:
    """DTensor works out an operator's global output shape by running it on fake tensors of
    the *global* shape — under the fake mode already active when there is one, where the trace
    and torch's memory tracker count them as allocations of this rank (a sharded optimizer step
    then shows whole-model temporaries that do not scale with the shard). For the trace's
    duration that propagation gets a fake mode of its own, which neither counts."""
    try:
        from torch.distributed.tensor import _sharding_prop
    except ImportError:
        yield
        return
    real = getattr(_sharding_prop, "detect_fake_mode", None)
    if real is None:
        yield
        return
    _sharding_prop.detect_fake_mode = lambda *a, **k: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = real


def fake_group(world: int, device: Any) -> Any:
    """A fake process group of ``world`` ranks (this process rank 0) and its device mesh, made
    before fake tensors are on (the mesh reads real tensors)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise EstimateError(
            "an FSDP2 estimate needs a process without a process group (run it on its own)"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    return init_device_mesh(device.type, (world,))


@contextlib.contextmanager
def group_closed(mesh: Any) -> Any:
    try:
        yield
    finally:
        if mesh is not None:
            import torch.distributed as dist

            dist.destroy_process_group()


def layers(model: Any) -> list[Any]:
    """The repeated blocks FSDP2 shards one by one: the longest ModuleList (a causal LM's
    decoder layers)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def vocab(model: Any) -> int:
    """Token ids to draw from: the config's vocabulary, else the first embedding's rows."""
    import torch

    v = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(v, int) and v > 0:
        return v
    emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return int(emb.num_embeddings) if emb is not None else 2

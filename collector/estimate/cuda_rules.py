"""CUDA's rules on a machine without CUDA: an estimate traced on fake CPU tensors standing in for
CUDA follows what CUDA would do, not what the CPU does.

Three rules change what a step holds:

* **Autocast.** CUDA's autocast casts a different set of operators than the CPU's (softmax, layer
  and RMS norm, exp, pow… run in float32 on CUDA; the CPU casts fewer to bfloat16, and no
  ``einsum``, ``mv``…), so the dtype of every saved activation differs. :func:`cuda_autocast`
  installs, for the duration of a trace, CUDA's policy as the CPU's autocast kernels (PyTorch's own
  ``AutocastCPU`` dispatch key, through ``torch.library``): the operator tables below are
  ``aten/src/ATen/autocast_mode.h``'s (torch 2.11–2.13; a test holds them to the installed
  header), the casts of parameters cached for the autocast region as ``cached_cast`` does, and
  every operator the CPU casts but CUDA does not left alone. Removed again on exit.
* **Scaled-dot-product attention.** CUDA picks a fused kernel (flash, memory-efficient) by dtype,
  head size, mask, dropout and grouped key/value heads, and falls back to the math kernel, which
  keeps each layer's attention probabilities (and dropout mask) for backward; the CPU picks
  otherwise (its math kernel whenever there is dropout). :class:`CudaAttention` routes
  ``F.scaled_dot_product_attention`` to the kernel CUDA would run, through that kernel's own
  operator (whose fake kernel gives its outputs and saved tensors): :func:`cuda_sdpa_choice`.
* **Dropout.** On CUDA ``dropout`` is the fused ``native_dropout``, which keeps a one-byte mask
  for backward; on the CPU it multiplies by a noise tensor of the input's dtype and keeps that
  (``aten/src/ATen/native/Dropout.cpp``, ``is_fused_kernel_acceptable``): four times the bytes
  in float32. :func:`cuda_dropout` runs the fused operator.

Torch's tracker counts a CUDA storage in multiples of 512 bytes and a CPU storage as it is: the
stand-in's per-kind figures can differ from CUDA's by under 512 bytes a tensor (a rotary
buffer, a step counter); the allocator model rounds every request as CUDA does.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = [
    "CUDA_FP32",
    "CUDA_FP32_SET_OPT_DTYPE",
    "CUDA_LOWER_PRECISION",
    "CUDA_PROMOTE",
    "CudaAttention",
    "cuda_autocast",
    "cuda_dropout",
    "cuda_sdpa_choice",
    "dispatcher_choice",
    "rules_choice",
]

# aten/src/ATen/autocast_mode.h: AT_FORALL_LOWER_PRECISION_FP (name, overload)
CUDA_LOWER_PRECISION = (
    ("_convolution", "deprecated"),
    ("_convolution", ""),
    ("conv1d", ""),
    ("conv2d", ""),
    ("conv3d", ""),
    ("conv_tbc", ""),
    ("conv_transpose1d", ""),
    ("conv_transpose2d", "input"),
    ("conv_transpose3d", "input"),
    ("convolution", ""),
    ("prelu", ""),
    ("addmm", ""),
    ("addmv", ""),
    ("addr", ""),
    ("matmul", ""),
    ("einsum", ""),
    ("mm", ""),
    ("mv", ""),
    ("linalg_vecdot", ""),
    ("linear", ""),
    ("addbmm", ""),
    ("baddbmm", ""),
    ("bmm", ""),
    ("chain_matmul", ""),
    ("linalg_multi_dot", ""),
    ("_thnn_fused_lstm_cell", ""),
    ("_thnn_fused_gru_cell", ""),
    ("lstm_cell", ""),
    ("gru_cell", ""),
    ("rnn_tanh_cell", ""),
    ("rnn_relu_cell", ""),
    ("_scaled_dot_product_flash_attention", ""),
    ("scaled_dot_product_attention", ""),
)
# AT_FORALL_FP32
_FP32_NAMES = """
acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan softplus
layer_norm native_layer_norm rms_norm group_norm nuclear_norm cosine_similarity poisson_nll_loss
cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss
huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm
logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d
_upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d
upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d
_upsample_bicubic2d_aa
"""
CUDA_FP32 = (
    *((name, "") for name in _FP32_NAMES.split()),
    ("pow", "Tensor_Scalar"),
    ("pow", "Tensor_Tensor"),
    ("pow", "Scalar"),
    ("frobenius_norm", "dim"),
    ("nuclear_norm", "dim"),
)
# AT_FORALL_FP32_SET_OPT_DTYPE
CUDA_FP32_SET_OPT_DTYPE = (
    ("prod", ""),
    ("prod", "dim_int"),
    ("softmax", "int"),
    ("log_softmax", "int"),
    ("cumprod", ""),
    ("cumsum", ""),
    ("linalg_vector_norm", ""),
    ("linalg_matrix_norm", ""),
    ("linalg_matrix_norm", "str_ord"),
    ("sum", ""),
    ("sum", "dim_IntList"),
)
# AT_FORALL_PROMOTE (and the two norms of AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE, fp32)
_PROMOTE_NAMES = """
addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add
"""
CUDA_PROMOTE = tuple((name, "") for name in _PROMOTE_NAMES.split())
CUDA_FP32_APPEND_DTYPE = (("norm", "Scalar"), ("norm", "ScalarOpt_dim"))


def _op(name: str, overload: str) -> Any:
    import torch

    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


class _Policy:
    """One operator's CUDA autocast kernel, run on the CPU's autocast key."""

    def __init__(self, op: Any, kind: str, dtype: Any, cache: dict[int, Any]) -> None:
        import torch

        self.op, self.kind, self.dtype, self.cache = op, kind, dtype, cache
        self.exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def _eligible(self, t: Any) -> bool:
        import torch

        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64

    def _cast(self, t: Any, to: Any) -> Any:
        import torch

        if isinstance(t, list | tuple):
            return type(t)(self._cast(x, to) for x in t)
        if not self._eligible(t) or t.dtype == to:
            return t
        cacheable = (
            to == self.dtype
            and t.dtype == torch.float32
            and t.requires_grad
            and t.is_leaf
            and not t._is_view()
            and torch.is_autocast_cache_enabled()
        )
        if cacheable:
            hit = self.cache.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
        out = t.to(to)
        if cacheable:
            self.cache[id(t)] = (t, out)
        return out

    def _promoted(self, args: tuple[Any, ...]) -> Any:
        import torch

        to = self.dtype
        for a in args:
            for t in a if isinstance(a, list | tuple) else (a,):
                if self._eligible(t) and torch.float32 in (t.dtype, to):
                    to = torch.float32
        return to

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        with torch._C._ExcludeDispatchKeyGuard(self.exclude):
            if self.kind == "lower":
                args, kwargs = self._cast_all(args, kwargs, self.dtype)
            elif self.kind == "fp32":
                args, kwargs = self._cast_all(args, kwargs, torch.float32)
            elif self.kind == "promote":
                args, kwargs = self._cast_all(args, kwargs, self._promoted(args))
            elif self.kind == "set_opt_dtype":
                if args and self._eligible(args[0]) and kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            elif self.kind == "append_dtype" and args and self._eligible(args[0]):
                args = (args[0].to(torch.float32), *args[1:])
            return self.op(*args, **kwargs)

    def _cast_all(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], to: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (
            tuple(self._cast(a, to) for a in args),
            {k: self._cast(v, to) for k, v in kwargs.items()},
        )


def _cpu_autocast_ops() -> list[tuple[str, str]]:
    """Every aten operator the CPU's autocast has a kernel of its own for."""
    import torch

    out = []
    for qual in torch._C._dispatch_get_all_op_names():
        if not qual.startswith("aten::"):
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(qual, "AutocastCPU"):
            name, _, overload = qual.removeprefix("aten::").partition(".")
            out.append((name, overload))
    return out


@contextlib.contextmanager
def cuda_autocast(dtype: Any) -> Iterator[None]:
    """CUDA's autocast policy (to ``dtype`` for the lower-precision operators) as the CPU's, for
    the duration: enter ``torch.autocast("cpu", dtype)`` inside it, as a CUDA step would enter
    ``torch.autocast("cuda", dtype)``."""
    import torch

    cache: dict[int, Any] = {}
    lib = torch.library.Library("aten", "IMPL")
    tables = (
        ("lower", CUDA_LOWER_PRECISION),
        ("fp32", CUDA_FP32),
        ("set_opt_dtype", CUDA_FP32_SET_OPT_DTYPE),
        ("promote", CUDA_PROMOTE),
        ("append_dtype", CUDA_FP32_APPEND_DTYPE),
    )
    done: set[tuple[str, str]] = set()
    real_clear = torch.clear_autocast_cache

    def clear() -> None:  # leaving the outermost autocast region: its casts are dropped
        cache.clear()
        real_clear()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        for kind, table in tables:
            for name, overload in table:
                op = _op(name, overload)
                if op is None:
                    continue
                lib.impl(
                    f"{name}.{overload}" if overload else name,
                    _Policy(op, kind, dtype, cache),
                    "AutocastCPU",
                )
                done.add((name, overload))
        for name, overload in _cpu_autocast_ops():
            if (name, overload) in done:
                continue
            op = _op(name, overload)
            if op is not None:  # the CPU casts it, CUDA does not
                lib.impl(
                    f"{name}.{overload}" if overload else name,
                    _Policy(op, "none", dtype, cache),
                    "AutocastCPU",
                )
    torch.clear_autocast_cache = clear
    try:
        yield
    finally:
        torch.clear_autocast_cache = real_clear
        cache.clear()
        lib._destroy()


def cuda_sdpa_choice(dtype: Any, head_dim: int, has_mask: bool, dropout: float, gqa: bool) -> str:
    """The kernel CUDA's dispatcher picks for ``scaled_dot_product_attention`` in training, as
    the H200 (sm90) answers with torch 2.11 (``benchmarks/results/fit/sdpa-choices.json``, held
    to these rules in the tests): half precision with a head size that is a multiple of 8 up to
    256 takes cuDNN's kernel (masks, dropout and grouped key/value heads included); another head
    size up to 256 without a mask, flash (the head padded to a multiple of 8); float32, and half
    precision beyond 256, the memory-efficient kernel unless key/value heads are grouped; the
    math kernel otherwise."""
    import torch

    half = dtype in (torch.float16, torch.bfloat16)
    if half and head_dim <= 256:
        if head_dim % 8 == 0:
            return "cudnn"
        if not has_mask:
            return "flash"
    if not gqa and head_dim % (8 if half else 4) == 0:
        return "efficient"
    return "math"


def dispatcher_choice(device: Any) -> Any:
    """On a GPU: ask CUDA's own dispatcher (``torch._fused_sdp_choice``) with a few real bytes of
    the same dtype, head layout, mask and dropout — fake tensors pass a fused kernel's shape
    rules where the real dispatcher has none. Answers are cached per layout."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
    cache: dict[tuple[Any, ...], str] = {}

    def choose(q: Any, k: Any, mask: Any, dropout: float, causal: bool, gqa: bool) -> str:
        key = (q.dtype, *q.shape[-3:], *k.shape[-3:], mask is not None, dropout > 0, gqa)
        if key not in cache:
            try:  # one sequence of the real layout (the kernels' rules read its lengths too)
                with unset_fake_temporarily():
                    lq, lk = q.shape[-2], k.shape[-2]
                    rq = torch.zeros(1, q.shape[-3], lq, q.shape[-1], device=device, dtype=q.dtype)
                    rk = torch.zeros(1, k.shape[-3], lk, k.shape[-1], device=device, dtype=q.dtype)
                    rm = (
                        torch.zeros(1, 1, lq, lk, device=device, dtype=q.dtype)
                        if mask is not None
                        else None
                    )
                    rq.requires_grad_(q.requires_grad)
                    c = torch._fused_sdp_choice(
                        rq,
                        rk,
                        rk,
                        rm,
                        dropout,
                        causal and mask is None,
                        scale=None,
                        enable_gqa=gqa,
                    )
                cache[key] = names.get(int(c), "math")
            except Exception:  # a torch without the probe: CUDA's rules as written down
                cache[key] = cuda_sdpa_choice(q.dtype, q.shape[-1], mask is not None, dropout, gqa)
        return cache[key]

    return choose


def rules_choice(q: Any, k: Any, mask: Any, dropout: float, causal: bool, gqa: bool) -> str:
    """Without a GPU: :func:`cuda_sdpa_choice`."""
    return cuda_sdpa_choice(q.dtype, q.shape[-1], mask is not None, dropout, gqa)


@contextlib.contextmanager
def cuda_dropout() -> Iterator[None]:
    """For its duration, ``torch.nn.functional.dropout`` (what ``nn.Dropout`` calls) in training
    runs ``aten.native_dropout`` as CUDA does (its saved mask is boolean), not the CPU's
    multiply by a noise tensor of the input's dtype. Replaced and put back, as
    :class:`CudaAttention` does, so a checkpointed forward's recomputation runs it too."""
    import torch

    real = torch.nn.functional.dropout

    def dropout(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        if training and 0 < p < 1 and input.numel() > 0 and not inplace:
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return real(input, p, training, inplace)

    torch.nn.functional.dropout = dropout
    try:
        yield
    finally:
        torch.nn.functional.dropout = real


class CudaAttention:
    """For its duration, ``torch.nn.functional.scaled_dot_product_attention`` runs the kernel CUDA
    would, through its own operator; ``choose`` picks it (:func:`dispatcher_choice` on a GPU,
    :func:`rules_choice` without one). ``autocast_dtype``: the dtype CUDA's autocast casts its
    inputs to (None: autocast off). ``chosen`` counts the kernels picked.

    The function itself is replaced (and put back on exit), not intercepted by a
    ``TorchFunctionMode``: a mode is off while it handles a call, so the recomputation of a
    checkpointed forward inside ``backward()`` would run the other kernel."""

    def __init__(self, autocast_dtype: Any = None, choose: Any = None) -> None:
        self.autocast_dtype = autocast_dtype
        self.choose = choose or rules_choice
        self.chosen: dict[str, int] = {}
        self._real: Any = None

    def __enter__(self) -> CudaAttention:
        import torch

        self._real = torch.nn.functional.scaled_dot_product_attention

        def sdpa(*args: Any, **kwargs: Any) -> Any:
            return _route(args, kwargs, self.autocast_dtype, self.choose, self.chosen)

        torch.nn.functional.scaled_dot_product_attention = sdpa
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        torch.nn.functional.scaled_dot_product_attention = self._real


def _route(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    autocast_dtype: Any,
    choose: Any,
    chosen: dict[str, int],
) -> Any:
    import torch

    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    a = dict(zip(names, args, strict=False)) | kwargs
    q, k, v = a["query"], a["key"], a["value"]
    mask, p = a.get("attn_mask"), float(a.get("dropout_p", 0.0))
    causal, scale, gqa = bool(a.get("is_causal", False)), a.get("scale"), a.get("enable_gqa", False)
    if autocast_dtype is not None and torch.is_autocast_enabled(q.device.type):
        q, k, v = (x.to(autocast_dtype) if x.dtype == torch.float32 else x for x in (q, k, v))
    grouped = bool(gqa) and q.shape[-3] != k.shape[-3]
    choice = choose(q, k, mask, p, causal, grouped)
    chosen[choice] = chosen.get(choice, 0) + 1
    if choice == "cudnn":
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, mask, True, p, causal, False, scale=scale
        )[0]
    if choice == "flash":
        d = q.shape[-1]
        if d % 8:  # SDPA pads the head to a multiple of 8 for flash and slices the output
            scale = scale if scale is not None else d**-0.5
            q, k, v = (torch.nn.functional.pad(x, (0, 8 - d % 8)) for x in (q, k, v))
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, p, causal, False, scale=scale
        )[0]
        return out[..., :d] if d % 8 else out
    if choice == "efficient":
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, p, causal, scale=scale
        )[0]
    return torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, mask, p, causal, None, scale=scale, enable_gqa=bool(gqa)
    )[0]

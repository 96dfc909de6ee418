"""Torch's memory tracker, with frozen parameters.

:class:`~torch.distributed._tools.mem_tracker.MemTracker` installs a gradient hook on every
parameter of a module it sees run forward, and ``register_hook`` raises on a tensor that does
not require a gradient: a model with frozen parameters (LoRA's base, a 4-bit QLoRA base) stops
it at its first forward (``RuntimeError: cannot register a hook on a tensor that doesn't require
gradient``; torch 2.11–2.13). :func:`tracker` gives torch's tracker, which files frozen
parameters as parameters like the rest and hooks only those that get gradients, and leaves out
storages marked as CUDA managed memory (:data:`MANAGED`: a paged optimizer's state, which torch's
pool never holds).
"""

from __future__ import annotations

from typing import Any

__all__ = ["file_quantisation_state", "managed", "tracker"]

MANAGED = "_stepmem_managed"  # a storage's mark: CUDA managed memory, outside torch's pool


def managed(t: Any) -> bool:
    """Whether ``t``'s storage is marked as managed memory (never counted as the device's)."""
    try:
        return bool(getattr(t.untyped_storage(), MANAGED, False))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


class _NoHook:
    """The handle of a hook a frozen parameter does not get."""

    def remove(self) -> None:
        return None


def tracker() -> Any:
    """A new memory tracker (see the module doc)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class FrozenAwareMemTracker(MemTracker):
        def _track_module_params_and_buffers(
            self, module: Any, install_grad_hooks: bool = True
        ) -> tuple[int, int]:
            handles = self._param_to_grad_hook_handles
            for p in module.parameters():
                if not p.requires_grad and handles.get(p, None) is None:
                    handles[p] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _track(self, reftype: Any, t: Any) -> None:
            if not managed(t):
                super()._track(reftype, t)

        def _update_and_maybe_create_winfos(
            self, t: Any, reftype: Any, update_existing: bool = False
        ) -> set[Any]:
            if managed(t):
                return set()
            return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

    return FrozenAwareMemTracker()


def _quantisation_tensors(weight: Any) -> list[Any]:
    """The tensors of a bitsandbytes weight's quantisation state (4-bit ``quant_state``, with
    its nested ``state2``; 8-bit ``SCB``)."""
    import torch

    out = []
    qs = getattr(weight, "quant_state", None)
    for state in (qs, getattr(qs, "state2", None)):
        for name in ("absmax", "code", "offset"):
            t = getattr(state, name, None)
            if isinstance(t, torch.Tensor):
                out.append(t)
    scb = getattr(weight, "SCB", None)
    if isinstance(scb, torch.Tensor):
        out.append(scb)
    return out


STEPS_TRACED = 2  # step 2 holds what step 1's optimizer step made: the steady one


def file_quantisation_state(tracker: Any, models: list[Any]) -> None:
    """A quantised weight's state (bitsandbytes' 4-bit ``absmax``, its nested absmax and maps;
    8-bit ``SCB``) is part of the weight: filed as parameters (the tracker would take them for
    activations, made outside a module's pass, or not see them at all, made before it)."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    for model in models:
        for module in model.modules():
            for t in _quantisation_tensors(getattr(module, "weight", None)):
                tracker._update_and_maybe_create_winfos(t, _MemRefType.PARAM)

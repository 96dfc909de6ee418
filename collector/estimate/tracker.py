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

import contextlib
from collections.abc import Iterator
from typing import Any

from collector.model.quantised import quantisation_tensors

__all__ = ["exact_bytes", "file_quantisation_state", "managed", "tracker"]

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

        def _register_global_optimizer_hook(self) -> None:
            """A closure the optimizer's ``step`` runs (Lightning's forward and backward) is
            not the optimizer step: its tensors are filed as activations and temporaries."""
            super()._register_global_optimizer_hook()
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            def closure_outside(optimizer: Any, args: Any, kwargs: Any) -> Any:
                # args are step's own, the optimizer first
                closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
                if closure is None:
                    return None

                def run() -> Any:
                    self._in_opt = False
                    try:
                        return closure()
                    finally:
                        self._in_opt = True

                if "closure" in kwargs:
                    return args, {**kwargs, "closure": run}
                return (args[0], run, *args[2:]), kwargs

            handle = register_optimizer_step_pre_hook(closure_outside)
            self._optimizer_hook_handles = (*self._optimizer_hook_handles, handle)

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


def file_quantisation_state(tracker: Any, models: list[Any]) -> None:
    """A quantised weight's state (bitsandbytes' 4-bit ``absmax``, its nested absmax and maps;
    8-bit ``SCB``) is part of the weight: filed as parameters (the tracker would take them for
    activations, made outside a module's pass, or not see them at all, made before it)."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    for model in models:
        for module in model.modules():
            for t in quantisation_tensors(getattr(module, "weight", None)):
                tracker._update_and_maybe_create_winfos(t, _MemRefType.PARAM)


@contextlib.contextmanager
def exact_bytes() -> Iterator[None]:
    """For the duration, the tracker counts a CUDA storage's own bytes, as the probe's ledger
    does, not rounded up to the caching allocator's 512-byte blocks (the allocator model rounds
    every request itself): a component's figure is its tensors' bytes, on a GPU as on the CPU."""
    from torch.distributed._tools import mem_tracker

    info = mem_tracker._WeakRefInfo
    real = info._calculate_mem_consumed
    info._calculate_mem_consumed = lambda self: self.size * self.element_size
    try:
        yield
    finally:
        info._calculate_mem_consumed = real

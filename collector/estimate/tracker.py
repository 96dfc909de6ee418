"""Torch's memory tracker, with frozen parameters.

:class:`~torch.distributed._tools.mem_tracker.MemTracker` installs a gradient hook on every
parameter of a module it sees run forward, and ``register_hook`` raises on a tensor that does
not require a gradient: a model with frozen parameters (LoRA's base, a 4-bit QLoRA base) stops
it at its first forward (``RuntimeError: cannot register a hook on a tensor that doesn't require
gradient``; torch 2.11–2.13). :func:`tracker` gives torch's tracker, which files frozen
parameters as parameters like the rest and hooks only those that get gradients — the one
difference.
"""

from __future__ import annotations

from typing import Any

__all__ = ["tracker"]


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

    return FrozenAwareMemTracker()

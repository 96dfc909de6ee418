"""The ledger: bytes of parameters, gradients and optimizer state per device, read from the
model's and optimizer's own tensors at each step end (:class:`collector.probe.core.StepProbe`
takes it through :class:`LedgerCache`)."""

from __future__ import annotations

from typing import Any

__all__ = ["LEDGER_KINDS", "LedgerCache", "ledger"]


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


LEDGER_KINDS = ("parameters", "gradients", "optimizer_state", "optimizer_state_managed")


def ledger(model: Any = None, optimizer: Any = None) -> dict[Any, dict[str, int]]:
    """Bytes of parameters, gradients and optimizer state, per ``torch.device`` they live on.

    Paged (managed) bitsandbytes state — CPU tensors marked ``is_paged`` — is attributed to
    ``cuda:<page_deviceid>`` under ``optimizer_state_managed``. Tensors are deduplicated by data
    pointer. One full pass over every tensor: see :class:`LedgerCache` for the per-step cost.
    """
    import torch

    out: dict[Any, dict[str, int]] = {}
    seen: set[int] = set()

    def add(device: Any, kind: str, t: Any) -> None:
        ptr = t.data_ptr()
        if ptr in seen:
            return
        seen.add(ptr)
        out.setdefault(device, dict.fromkeys(LEDGER_KINDS, 0))[kind] += _nbytes(t)

    if model is not None:
        for p in model.parameters():
            add(p.device, "parameters", p)
            if p.grad is not None:
                add(p.grad.device, "gradients", p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if not isinstance(v, torch.Tensor):
                    continue
                if getattr(v, "is_paged", False):
                    dev = torch.device("cuda", getattr(v, "page_deviceid", 0) or 0)
                    add(dev, "optimizer_state_managed", v)
                else:
                    add(v.device, "optimizer_state", v)
    return out


class LedgerCache:
    """The ledger at a per-step cost of one attribute check per parameter.

    A full :func:`ledger` pass over a 7B model with 8-bit optimizer state touches ~2,000 tensors
    (≈6 ms on the H200 host). Parameter and optimizer-state inventories change when state is
    created (the first ``optimizer.step()``), so the full pass is redone only when
    ``len(optimizer.state)`` changes, or every ``refresh_steps`` steps. Per step, gradients are
    counted from cached parameter sizes for
    every parameter whose ``.grad`` is set (gradients have their parameter's size and device).
    """

    def __init__(self, refresh_steps: int = 100) -> None:
        self.refresh_steps = refresh_steps
        self.full_passes = 0
        self._n_state: int | None = None
        self._taken_at = 0
        self._static: dict[Any, dict[str, int]] = {}
        self._params: list[tuple[Any, Any, int]] = []

    def take(self, model: Any, optimizer: Any, step: int) -> dict[Any, dict[str, int]]:
        n_state = len(optimizer.state) if optimizer is not None else 0
        if n_state != self._n_state or step - self._taken_at >= self.refresh_steps:
            self._static = ledger(model, optimizer)
            self._params = (
                [(p, p.device, _nbytes(p)) for p in model.parameters()] if model is not None else []
            )
            self._n_state = n_state
            self._taken_at = step
            self.full_passes += 1
            for led in self._static.values():
                led["gradients"] = 0
        out = {dev: dict(led) for dev, led in self._static.items()}
        for p, dev, nbytes in self._params:
            if p.grad is not None:
                out.setdefault(dev, dict.fromkeys(LEDGER_KINDS, 0))["gradients"] += nbytes
        return out

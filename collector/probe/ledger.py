"""The ledger: bytes of parameters, gradients and optimizer state per device, read from the
model's and optimizer's own tensors at each step end (:class:`collector.probe.core.StepProbe`
takes it through :class:`LedgerCache`), as this process (this rank) holds them.

How each way of sharding is counted:

* **FSDP2** (``fully_shard``): parameters, their gradients and the optimizer's state are
  DTensors; the ledger counts each one's *local shard* (``_local_tensor``), what this rank
  holds. The unsharded (all-gathered) parameters exist only while a group is unsharded, inside
  forward and backward: :class:`UnshardWatch` follows each FSDP parameter group's transitions
  and gives the most bytes unsharded at once during the step, ``unsharded_parameters_peak``
  (gone by the step's end; the all-gather and reduce-scatter buffers around them are
  transient too, and stepmem sees them only inside the within-step peak).
* **DDP**: gradients as usual; the reducer's gradient buckets (``bucket_sizes`` of DDP's own
  logging data) are ``gradient_bucket_bytes``; with ``gradient_as_bucket_view=False`` they are a
  second copy of the gradients, ``gradient_buckets`` (what ``gradient_as_bucket_view=True``
  would save), with ``True`` the gradients are views into them and ``gradient_buckets`` is 0.
* Tensors that share memory (views, tied weights) are counted once.
"""

from __future__ import annotations

import logging
from typing import Any

from collector.model.kinds import LEDGER_KINDS, LedgerFigure, MemoryKind
from collector.model.quantised import quantisation_tensors

__all__ = ["LedgerCache", "UnshardWatch", "ledger"]

log = logging.getLogger(__name__)


def _local(t: Any) -> Any:
    """The tensor this rank holds: a DTensor's local shard, any other tensor itself."""
    return getattr(t, "_local_tensor", t)


def _nbytes(t: Any) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _ddp_of(model: Any) -> Any:
    """The DistributedDataParallel wrapper, if ``model`` is one (or wraps one)."""
    for m in (model, getattr(model, "module", None)):
        if m is not None and type(m).__name__ == "DistributedDataParallel":
            return m
    return None


def _ddp_buckets(ddp: Any) -> tuple[int, bool]:
    """(bucket bytes, whether gradients are views into them) of a DDP model; (0, True) when
    DDP does not say (its logging data is what ``torch.nn.parallel`` records itself)."""
    try:
        data = ddp._get_ddp_logging_data()
        sizes = [int(x) for x in str(data.get("bucket_sizes", "")).split(",") if x.strip()]
        return sum(sizes), bool(getattr(ddp, "gradient_as_bucket_view", False))
    except Exception as exc:  # another torch: the ledger goes on without buckets
        log.debug("DDP bucket sizes unavailable: %s", exc)
        return 0, True


def ledger(model: Any = None, optimizer: Any = None) -> dict[Any, dict[str, int]]:
    """Bytes of parameters, gradients and optimizer state, per ``torch.device`` they live on,
    as this rank holds them (see the module docstring for FSDP2 and DDP).

    A quantised weight's state (bitsandbytes' 4-bit absmax, nested absmax and maps: see
    :mod:`collector.model.quantised`) counts with its parameter.
    Paged (managed) bitsandbytes state — CPU tensors marked ``is_paged`` — is attributed to
    ``cuda:<page_deviceid>`` under ``optimizer_state_managed``. Tensors are deduplicated by data
    pointer. One full pass over every tensor: see :class:`LedgerCache` for the per-step cost.
    """
    import torch

    out: dict[Any, dict[str, int]] = {}
    seen: set[int] = set()

    def add(device: Any, kind: str, t: Any) -> None:
        t = _local(t)
        ptr = t.data_ptr()
        if ptr in seen and ptr:
            return
        seen.add(ptr)
        out.setdefault(device, dict.fromkeys(LEDGER_KINDS, 0))[kind] += _nbytes(t)

    if model is not None:
        for p in model.parameters():
            add(_local(p).device, MemoryKind.PARAMETERS, p)
            for q in quantisation_tensors(p):  # a 4-bit weight's absmax and maps: the weight's
                add(_local(q).device, MemoryKind.PARAMETERS, q)
            if p.grad is not None:
                add(_local(p.grad).device, MemoryKind.GRADIENTS, p.grad)
        ddp = _ddp_of(model)
        if ddp is not None:
            buckets, views = _ddp_buckets(ddp)
            dev = next((_local(p).device for p in ddp.parameters()), None)
            if dev is not None and buckets:
                led = out.setdefault(dev, dict.fromkeys(LEDGER_KINDS, 0))
                led[LedgerFigure.BUCKET_BYTES] = buckets
                led[MemoryKind.GRADIENT_BUCKETS] = 0 if views else buckets
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if not isinstance(v, torch.Tensor):
                    continue
                if getattr(v, "is_paged", False):
                    dev = torch.device("cuda", getattr(v, "page_deviceid", 0) or 0)
                    add(dev, MemoryKind.OPTIMIZER_STATE_MANAGED, v)
                else:
                    add(_local(v).device, MemoryKind.OPTIMIZER_STATE, v)
    return out


class LedgerCache:
    """The ledger at a per-step cost of one attribute check per parameter.

    A full :func:`ledger` pass over a 7B model with 8-bit optimizer state touches ~2,000 tensors
    (≈6 ms on the H200 host). Parameter and optimizer-state inventories change when state is
    created (the first ``optimizer.step()``), so the full pass is redone only when
    ``len(optimizer.state)`` changes, or every ``refresh_steps`` steps. Per step, gradients are
    counted from cached parameter sizes for
    every parameter whose ``.grad`` is set (gradients have their parameter's size and device:
    under FSDP2 the local shard's).
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
                [(p, _local(p).device, _nbytes(p)) for p in model.parameters()]
                if model is not None
                else []
            )
            self._n_state = n_state
            self._taken_at = step
            self.full_passes += 1
            for led in self._static.values():
                led[MemoryKind.GRADIENTS] = 0
        out = {dev: dict(led) for dev, led in self._static.items()}
        for p, dev, nbytes in self._params:
            if p.grad is not None:
                out.setdefault(dev, dict.fromkeys(LEDGER_KINDS, 0))[MemoryKind.GRADIENTS] += nbytes
        return out


class UnshardWatch:
    """The most bytes of FSDP2 parameters unsharded at once since the last :meth:`take`.

    FSDP2 all-gathers a parameter group before its module's forward (and again before its
    backward) and frees the unsharded copy after (``reshard_after_forward``); with prefetching,
    two groups may be unsharded together. The watch wraps each FSDP parameter group's
    ``_to_unsharded`` / ``_to_sharded`` / ``_to_sharded_post_forward`` — the transitions
    FSDP2's own ``FSDPMemTracker`` follows through the group's hooks — and keeps a running
    count: a few Python calls per group per step, nothing per tensor. ``attached`` is 0 when
    the model has no FSDP2 module (or a torch whose FSDP2 lacks these methods)."""

    def __init__(self, model: Any) -> None:
        self.current = 0
        self.peak = 0
        self.attached = 0
        self._sizes: dict[int, int] = {}
        for module in getattr(model, "modules", lambda: [])():
            get_state = getattr(module, "_get_fsdp_state", None)
            if get_state is None:
                continue
            try:
                group = get_state()._fsdp_param_group
            except Exception:
                continue
            if group is not None and self._wrap(group):
                self.attached += 1

    def _wrap(self, group: Any) -> bool:
        names = ("_to_unsharded", "_to_sharded", "_to_sharded_post_forward")
        if not all(hasattr(group, n) for n in names) or getattr(group, "_stepmem_watch", None):
            return False

        def around(orig: Any) -> Any:
            def inner(*args: Any, **kwargs: Any) -> Any:
                was = bool(group.is_unsharded)
                out = orig(*args, **kwargs)
                now = bool(group.is_unsharded)
                if now and not was:
                    self._unsharded(group, +1)
                elif was and not now:
                    self._unsharded(group, -1)
                return out

            return inner

        for name in names:
            setattr(group, name, around(getattr(group, name)))
        group._stepmem_watch = self
        return True

    def _unsharded(self, group: Any, sign: int) -> None:
        key = id(group)
        if key not in self._sizes:  # the first time it is unsharded: its params are there
            try:
                self._sizes[key] = sum(
                    fp.unsharded_param.numel() * fp.unsharded_param.element_size()
                    for fp in group.fsdp_params
                )
            except Exception:
                self._sizes[key] = 0
        self.current = max(0, self.current + sign * self._sizes[key])
        self.peak = max(self.peak, self.current)

    def take(self) -> int:
        """The peak since the last call; the next period starts from what is unsharded now."""
        peak, self.peak = self.peak, self.current
        return peak

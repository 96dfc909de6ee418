"""bitsandbytes' paged optimizers under the estimate: their large state in CUDA managed memory.

A paged optimizer (``PagedAdamW8bit``, ``PagedAdamW``…) keeps the state of every tensor of 10^5
elements or more in CUDA managed memory (``bitsandbytes.functional.get_paged``:
``cudaMallocManaged``), outside torch's pool: torch's counters never show it, NVML does once its
pages sit on the GPU. Under fake tensors that call would allocate real managed memory, and on the
CPU stand-in bitsandbytes falls back to ordinary state. :func:`paged_state` makes each such
buffer a fake tensor that neither the tracker nor the allocation log counts, and adds its bytes to
the optimizer's ``stepmem_managed`` — the estimate's ``optimizer_state_managed``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from collector.estimate.alloc_log import AllocationLog
from collector.estimate.swap import swapped
from collector.estimate.tracker import MANAGED

__all__ = ["PAGED_MIN", "paged_state"]

PAGED_MIN = 100_000  # bitsandbytes: state of tensors with at least this many elements is paged


def _uncounted(t: Any, tracker: Any, log: AllocationLog | None) -> None:
    """``t``'s storage out of the tracker's figures and the allocation log."""
    from torch.distributed._tools.mem_tracker import _UpdateType

    st = t.untyped_storage()
    setattr(st, MANAGED, True)  # the tracker files it no more (collector.estimate.tracker)
    winfo, _ = tracker._WINFO.pop(st, (None, None))
    if winfo is not None and winfo.mem_consumed > 0:
        tracker._update_snap(_UpdateType.DEL, winfo)
        winfo.mem_consumed = 0  # its finaliser subtracts nothing again
    if log is not None:
        key = log.key_of(t)
        if key is not None:
            log.drop({key})


@contextlib.contextmanager
def paged_state(tracker: Any, log: AllocationLog | None) -> Iterator[None]:
    """For the duration, bitsandbytes' paged state is managed memory (see the module doc)."""
    try:
        from bitsandbytes.optim.optimizer import Optimizer8bit
    except ImportError:
        yield
        return
    import torch

    def get_state_buffer(self: Any, p: Any, dtype: Any = torch.float32) -> Any:
        buff = torch.zeros_like(p, dtype=dtype, device=p.device)
        if self.is_paged and p.numel() >= PAGED_MIN:
            _uncounted(buff, tracker, log)
            self.stepmem_managed = getattr(self, "stepmem_managed", 0) + buff.nbytes
        return buff

    with swapped(Optimizer8bit, get_state_buffer=get_state_buffer):
        yield

"""The user's own peak counters, kept while the probe resets torch's.

The probe reads each step's within-step peaks by resetting the caching allocator's peak
statistics at every mark (``torch.cuda.reset_peak_memory_stats``: process-wide, one set per
device). A training loop that logs ``torch.cuda.max_memory_allocated()`` would then see the
peak since the probe's last mark, not since its own reset — adding the probe's three lines
would quietly change what the user's own logging says.

:class:`UserPeaks` keeps what those resets took away: before each reset the probe hands it the
statistics it read, and it keeps, per device, the highest value of every ``peak`` statistic
since the user's own last reset. The user's view is torch's with those carried peaks put back:
``torch.cuda.memory_stats_as_nested_dict`` (which ``memory_stats``, ``max_memory_allocated``,
``max_memory_reserved`` and ``memory_summary`` all read) answers ``max(torch's peak, carried)``,
and the user's own ``reset_peak_memory_stats`` (``reset_max_memory_allocated`` calls it) clears
the carried peaks as well as torch's. The probe reads torch's own figures through
:attr:`UserPeaks.real_stats` and resets through :attr:`UserPeaks.real_reset`.

Installed once per process, by the first probe that resets peaks on a GPU; never raises into
training (a torch whose functions are not where this was written for is left alone).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["UserPeaks", "user_peaks"]


def _device_key(d: Any) -> Any:
    """One key per device, whatever form the caller named it in (None: the current one)."""
    import torch

    try:
        return torch.cuda._get_device_index(d, optional=True)
    except Exception:
        return d


class UserPeaks:
    """See the module doc."""

    def __init__(self) -> None:
        import torch.cuda.memory as mem

        self.real_stats: Callable[..., dict[str, Any]] = mem.memory_stats_as_nested_dict
        self.real_reset: Callable[..., None] = mem.reset_peak_memory_stats
        self._carried: dict[Any, dict[tuple[str, ...], int]] = {}
        self._lock = threading.Lock()

    def carry(self, device: Any, nested: dict[str, Any]) -> None:
        """Keep the peaks of ``nested`` (torch's statistics, read just before the probe resets
        them) as the user's, each the higher of this and what was kept before."""
        found: list[tuple[tuple[str, ...], int]] = []
        _peaks(nested, (), found)
        key = _device_key(device)
        with self._lock:
            kept = self._carried.setdefault(key, {})
            for path, v in found:
                if v > kept.get(path, -1):
                    kept[path] = v

    def stats(self, device: Any = None) -> dict[str, Any]:
        """Torch's statistics with the carried peaks put back (the user's view)."""
        nested = self.real_stats(device)
        with self._lock:
            kept = dict(self._carried.get(_device_key(device), {}))
        for path, v in kept.items():
            node = nested
            for part in path[:-1]:
                node = node.get(part) if isinstance(node, dict) else None
                if node is None:
                    break
            if isinstance(node, dict) and isinstance(node.get(path[-1]), int):
                node[path[-1]] = max(node[path[-1]], v)
        return nested

    def reset(self, device: Any = None) -> None:
        """The user's own reset: torch's peaks and the carried ones."""
        with self._lock:
            self._carried.pop(_device_key(device), None)
        self.real_reset(device)

    def install(self) -> None:
        import torch.cuda
        import torch.cuda.memory as mem

        for owner in (mem, torch.cuda):
            if hasattr(owner, "memory_stats_as_nested_dict"):
                owner.memory_stats_as_nested_dict = self.stats
            if hasattr(owner, "reset_peak_memory_stats"):
                owner.reset_peak_memory_stats = self.reset


def _peaks(node: Any, path: tuple[str, ...], out: list[tuple[tuple[str, ...], int]]) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            _peaks(v, (*path, str(k)), out)
    elif path and path[-1] == "peak" and isinstance(node, int):
        out.append((path, node))


_installed: list[UserPeaks] = []
_install_lock = threading.Lock()


def user_peaks() -> UserPeaks | None:
    """This process's :class:`UserPeaks`, installed at the first call (None: torch's memory
    functions are not where they were when this was written)."""
    with _install_lock:
        if not _installed:
            try:
                keeper = UserPeaks()
                keeper.install()
            except Exception:
                return None
            _installed.append(keeper)
        return _installed[0]

"""Step marks taken by a listener instead of the probe: ``stepmem estimate --script`` runs the
user's script, its probe lines unchanged, and the marks those lines make (``StepProbe.begin``,
``phase``, ``end``, the Hugging Face and Lightning callbacks through them) tell the estimate
where each step begins and ends. While a listener is set, a probe does nothing of its own (no
allocator reading, no sampler, no events): every mark goes to the listener.

The listener ends the script when it has what it needs by raising :class:`TraceDone` from a
mark; it derives from ``BaseException`` so that neither the probe's guard nor a training loop's
``except Exception`` keeps it.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["MarkListener", "TraceDone", "listen", "listening"]


class TraceDone(BaseException):
    """The estimate has traced the steps it needs: the script stops here."""


class MarkListener(Protocol):
    def watch(self, model: Any, optimizer: Any) -> None: ...
    def begin(self, step: int) -> None: ...
    def phase(self, name: str) -> None: ...
    def end(self) -> None: ...
    def fail(self, exc: BaseException | None) -> None: ...


_LISTENER: list[MarkListener | None] = [None]


def listen(listener: MarkListener | None) -> None:
    """Hand this process's step marks to ``listener`` (None: back to the probes)."""
    _LISTENER[0] = listener


def listening() -> MarkListener | None:
    return _LISTENER[0]

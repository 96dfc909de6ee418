"""The error types the ``stepmem`` command shows as a user's problem.

Anything raised as a :class:`StepmemError` (bad input, a missing capture, a run directory that
is not one, no GPU for the live backend) is printed as one line and exits 2. Any other exception
reaching the command is a bug in stepmem: it prints its traceback and says so. Each domain
raises its own subclass (``CaptureError``, ``StoreError``, ``NvmlError``, ``HistoryError`` beside
their code; :class:`EstimateError` here, as the estimate and the readers of its file share it).
"""

from __future__ import annotations

__all__ = ["EstimateError", "InputError", "StepmemError", "UserError", "first_line"]


def first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's message as one line of at most ``limit`` characters (its type's name when
    it says nothing): how a warning, a problem or a user error quotes it."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:limit]


class StepmemError(Exception):
    """Something the user can fix; the message is one line that names it."""


class InputError(StepmemError, ValueError):
    """A file or value that is not what stepmem reads (records, run metadata, baselines)."""


class UserError(StepmemError):
    """A command line the user can fix, its message already prefixed with the command
    (``stepmem run: --run-id …``): printed as it is."""


class EstimateError(StepmemError):
    """The estimate cannot be made, or an estimate file cannot be read: one line, exit 2."""

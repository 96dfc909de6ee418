"""The one error type the ``stepmem`` command shows as a user's problem.

Anything raised as a :class:`StepmemError` (bad input, a missing capture, a run directory that
is not one, no GPU for the live backend) is printed as one line and exits 2. Any other exception
reaching the command is a bug in stepmem: it prints its traceback and says so.
"""

from __future__ import annotations

__all__ = ["InputError", "StepmemError"]


class StepmemError(Exception):
    """Something the user can fix; the message is one line that names it."""


class InputError(StepmemError, ValueError):
    """A file or value that is not what stepmem reads (records, run metadata, baselines)."""

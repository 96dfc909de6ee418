"""Attributes swapped for a block and put back: how the estimate bends a library to fake tensors
for the duration of a script (a method, a function of a module, a class's property)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["swapped"]

_ABSENT = object()


@contextlib.contextmanager
def swapped(owner: Any, **values: Any) -> Iterator[None]:
    """``owner``'s attributes set to ``values`` for the block; afterwards each is what ``owner``
    itself held before, or removed when it held none (an inherited one shows through again)."""
    before = {name: vars(owner).get(name, _ABSENT) for name in values}
    for name, value in values.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)

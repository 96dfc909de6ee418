"""Reading what somebody else wrote: every file stepmem reads is data from an unknown hand
(a run store, a records file, an estimate, a config, a calibration), and every string in it
ends up printed somewhere.

* :func:`read_json` reads a regular file of bounded size (never a device, a FIFO or ``/proc``:
  those report size 0 and never end), as UTF-8 JSON without ``NaN``/``Infinity`` and nested at
  most :data:`MAX_DEPTH` deep; anything else is one :class:`ValueError` line naming why.
* :func:`inert` cuts a string read from data to :data:`MAX_TEXT_CHARS` and strips its C0 and C1
  control characters (terminal escapes: colours, the window title, the clipboard through OSC 52,
  concealed text), so what is printed is what is there, at a bounded length. Rich markup in
  such strings is the printer's to escape (a ``rich.text.Text``, never a markup string).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_TEXT_CHARS", "depth", "inert", "read_json"]

MAX_DEPTH = 64  # stepmem's own files nest a handful of levels
MAX_TEXT_CHARS = 4096  # a string read from data, as printed (an error, a name, a banner)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def inert(s: str, limit: int = MAX_TEXT_CHARS) -> str:
    """``s`` without control characters (tabs and newlines kept as spaces), cut to ``limit``
    characters first (a string read from data is printed, and a 50 MiB one would make every
    later step of a report walk it): what is cut ends in ``…``."""
    if not s:
        return s
    cut = s[:limit] + "…" if len(s) > limit else s
    return _CONTROL.sub("", cut.replace("\t", " ").replace("\n", " "))


def depth(v: Any, limit: int = MAX_DEPTH) -> int:
    """How deep ``v`` nests (lists and dicts), counted up to ``limit + 1`` without recursion."""
    deepest, todo = 0, [(v, 1)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, dict | list):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            todo.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return deepest


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def read_json(path: str | Path, limit: int, what: str = "") -> Any:
    """The JSON document in ``path``: a regular file of at most ``limit`` bytes, UTF-8, strict
    numbers, at most :data:`MAX_DEPTH` deep. :class:`ValueError` (one line, prefixed with
    ``what`` or the path) otherwise; :class:`FileNotFoundError` passes through."""
    name = what or str(path)
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{name}: not a regular file")
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{name}: larger than {limit:,} bytes")
    return loads_json(data, name)


def loads_json(data: bytes, name: str) -> Any:
    """``data`` as JSON, checked as :func:`read_json` checks a file's (UTF-8, strict numbers,
    at most :data:`MAX_DEPTH` deep): one-line :class:`ValueError` prefixed with ``name``."""
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_constant)
    except RecursionError:
        raise ValueError(f"{name}: not JSON (nested too deeply)") from None
    except UnicodeDecodeError:
        raise ValueError(f"{name}: not UTF-8 text") from None
    except ValueError as exc:
        raise ValueError(f"{name}: not JSON ({str(exc)[:200]})") from None
    if depth(doc) > MAX_DEPTH:
        raise ValueError(f"{name}: nested more than {MAX_DEPTH} deep")
    return doc

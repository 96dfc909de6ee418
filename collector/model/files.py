"""A file written whole or not at all: :func:`atomic_write`, the one way stepmem writes a file
somebody reads (run stores, captures, estimates, targets, outputs)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write"]


def atomic_write(
    path: Path,
    data: str | bytes | Callable[[Path], object],
    *,
    private: bool = False,
    same_suffix: bool = False,
) -> None:
    """Write ``data`` (text, bytes, or a function that writes the file it is given) to a
    temporary file beside ``path`` (``.NAME.PID.tmp``) and rename it over ``path``. A failure (a
    full disk, Ctrl-C) leaves ``path`` as it was and no temporary behind, and is raised.
    ``private``: the file is the owner's only (0600). ``same_suffix``: the temporary ends in
    ``path``'s suffix (``.NAME.PID.tmp.png``), for a writer that picks its format by it."""
    path = Path(path)
    tail = (
        f"{path.stem}.{os.getpid()}.tmp{path.suffix}"
        if same_suffix
        else f"{path.name}.{os.getpid()}.tmp"
    )
    tmp = path.with_name("." + tail)
    try:
        if isinstance(data, str):
            tmp.write_text(data)
        elif isinstance(data, bytes | bytearray):
            tmp.write_bytes(data)
        else:
            data(tmp)
        if private:
            os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

"""What the ``stepmem`` command checks about the files it writes, before any work starts, and
how it writes them (whole or not at all)."""

from __future__ import annotations

import os
import re
import socket
import tempfile
from pathlib import Path

from collector.model.errors import UserError
from collector.model.files import atomic_write

__all__ = [
    "RUN_ID",
    "check_metrics_addr",
    "check_store",
    "default_store",
    "writable_file",
    "write_output",
]

RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def writable_file(
    path: Path | str, flag: str, prog: str, inputs: tuple[Path | None, ...] = ()
) -> Path:
    """Refuse an output file that cannot be written, before any work starts: a folder (or a
    name ending in /), a missing folder, a folder this user cannot create files in (tried, not
    guessed: root passes every permission check), something that is not a plain file, and any
    of the command's ``inputs`` or a file inside an input run directory (an output never
    overwrites what it was made from). Returns the path."""
    text = str(path)
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{prog}: {flag} {text} is a directory, not a file")
    if text.endswith(("/", os.sep)):
        raise UserError(f"{prog}: {flag} {text} ends with '/': give a file name")
    if path.exists() and not path.is_file():
        raise UserError(f"{prog}: {flag} {text} is not a plain file")
    target = path.resolve()
    for src in inputs:
        if src is None or not src.exists():
            continue
        src = src.resolve()
        if target == src or (src.is_dir() and src in target.parents):
            raise UserError(
                f"{prog}: {flag} {text} is {'inside ' if src.is_dir() else ''}an input of this "
                f"command ({src}); write it elsewhere: an output never overwrites its input"
            )
    folder = path.parent
    if not folder.is_dir():
        raise UserError(f"{prog}: {flag} {text}: the folder {folder} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".stepmem-probe-"):
            pass
    except OSError as exc:
        raise UserError(
            f"{prog}: {flag} {text}: cannot write in {folder} ({exc.strerror})"
        ) from None
    return path


def write_output(path: Path, data: str | bytes, flag: str, prog: str) -> None:
    """Write an output file whole or not at all (a temporary file renamed over it): a full
    disk leaves the old file, never a torn one, and is one line, not a traceback."""
    try:
        atomic_write(path, data)
    except OSError as exc:
        raise UserError(
            f"{prog}: {flag} {path} could not be written ({exc.strerror or exc})"
        ) from None


def default_store() -> Path:
    """Where runs go without ``--store``: ``$STEPMEM_STORE``; else, in a job started by ``ray job
    submit`` (its working directory is a copy under Ray's runtime_resources, deleted when Ray
    cleans up), ``~/stepmem-runs``; else ``runs/`` here."""
    if os.environ.get("STEPMEM_STORE"):
        return Path(os.environ["STEPMEM_STORE"])
    submitted = (
        "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ or "runtime_resources" in Path.cwd().parts
    )
    return Path.home() / "stepmem-runs" if submitted else Path("runs")


def check_store(store: Path | None, run_id: str, no_store: bool) -> Path | None:
    """The run store root a run writes to (``--store``, else :func:`default_store`; None with
    ``--no-store``), checked: writable, and the run's folder new (a run never overwrites
    another); ``--run-id`` is a plain name, so the run stays inside ``--store``."""
    if run_id and (not RUN_ID.fullmatch(run_id) or run_id in (".", "..")):
        raise UserError(
            f"stepmem run: --run-id {run_id!r}: a folder name inside --store: letters, "
            "digits, '.', '_' and '-', starting with a letter or digit, at most 128 characters"
        )
    if no_store:
        return None
    given = "--store"
    if store is None:
        store = default_store()
        given = "STEPMEM_STORE" if os.environ.get("STEPMEM_STORE") else "the default store"
    where = f"stepmem run: {given} {store}"
    if store.exists() and not store.is_dir():
        raise UserError(f"{where} is a file, not a folder")
    try:
        store.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=store, prefix=".stepmem-probe-"):
            pass
    except OSError as exc:
        raise UserError(f"{where}: cannot write there ({exc.strerror or exc})") from None
    if run_id and (store / run_id).exists():
        raise UserError(
            f"stepmem run: the run store {store / run_id} already exists; choose another "
            "--run-id (or remove that folder): a run never overwrites another"
        )
    return store


def check_metrics_addr(addr: str | None, prog: str) -> None:
    if not addr:
        return
    try:
        socket.getaddrinfo(addr, None)
    except (OSError, UnicodeError) as exc:
        raise UserError(f"{prog}: --metrics-addr {addr!r} does not resolve ({exc})") from None

"""Real training workloads for stepmem: ``finetune`` (the seed scenario), ``spiky`` (known
transients), ``patterns`` (a leak, an allocator jump, an OOM) and ``distributed`` (DDP or
FSDP2, one probe a rank).

Each is a module with ``parser()``, ``run(args, probe)`` and optionally ``check(args)`` (validates
values, raises ``ValueError``; no GPU needed) and ``defaults(args)`` (fills what depends on the
machine, at run time). The job and the command line go through :func:`parse` and :func:`run`.
"""

from __future__ import annotations

import argparse
import importlib
import json
from typing import Any

from collector.model.errors import InputError

WORKLOADS = ("finetune", "spiky", "patterns", "distributed")


def load(name: str) -> Any:
    """The module of a built-in workload; ``ValueError`` for an unknown name."""
    if name not in WORKLOADS:
        raise InputError(f"unknown workload {name!r} ({', '.join(WORKLOADS)})")
    return importlib.import_module(f"workloads.{name}")


def parse(name: str, argv: list[str]) -> tuple[Any, argparse.Namespace]:
    """The workload's module and its parsed, checked arguments; ``ValueError`` with one line
    (argparse's message or the workload's check), never a usage dump or an exit."""
    wl = load(name)
    p = wl.parser()

    def error(message: str) -> None:
        raise InputError(f"workload {name}: {message}")

    p.error = error  # type: ignore[method-assign]
    return wl, _checked(wl, p, argv, error)


def _checked(wl: Any, p: argparse.ArgumentParser, argv: list[str] | None, error: Any) -> Any:
    """``argv`` parsed by ``p`` and checked by the workload's ``check``; ``error(message)``
    for a value the check refuses."""
    args = p.parse_args(argv)
    if hasattr(wl, "check"):
        try:
            wl.check(args)
        except ValueError as exc:
            error(str(exc))
    return args


def script_args(
    wl: Any, argv: list[str] | None
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """A workload run as a script: its parser and its parsed, checked arguments; a bad value
    exits 2 with argparse's usage line."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    p = wl.parser()
    return p, _checked(wl, p, argv, p.error)


def run(wl: Any, args: argparse.Namespace, probe: Any) -> dict[str, Any]:
    """Run a parsed workload under ``probe``: a step the workload leaves open when it raises
    (the HF callback's) ends as failed; the probe is closed either way."""
    if hasattr(wl, "defaults"):
        args = wl.defaults(args)
    try:
        return wl.run(args, probe)
    except BaseException as exc:
        probe.fail(exc)
        raise
    finally:
        probe.close()


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Options the small GPU workloads (``spiky``, ``patterns``) share."""
    from pathlib import Path

    p.add_argument("--base-mib", type=int, default=1024, help="resident working set (MiB)")
    p.add_argument("--pause-ms", type=float, default=10.0, help="idle time between steps")
    p.add_argument("--no-probe", action="store_true")
    p.add_argument("--summary", type=Path, help="also write the summary (JSON) here")


def finish(summary: dict[str, Any], probe: Any, summary_path: Any) -> int:
    """The end of a workload run as a script: close its probe, print the summary as JSON (and
    write it to ``summary_path`` if given)."""
    if probe is not None:
        probe.close()
        summary["probe_cost_ns"] = probe.cost_ns
    text = json.dumps(summary, indent=1)
    if summary_path:
        summary_path.write_text(text)
    print(text)
    return 0

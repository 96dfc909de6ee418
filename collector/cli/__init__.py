"""The ``stepmem`` command: it parses (:mod:`.parsers`) and dispatches (:mod:`.commands`).

    stepmem run        the main job: samplers on every GPU, a workload under the probe, step table
    stepmem report     a run's per-step table and its diagnosis; compare, baseline, estimate, …

A user error (bad flag, missing capture, unknown GPU: any :class:`StepmemError`) prints one line
and exits 2; never a traceback. Anything else is a bug in stepmem: its traceback, a line that says
so, exit 70.
"""

from __future__ import annotations

import logging
import sys

from collector.model.errors import StepmemError, UserError, first_line

__all__ = ["EXIT_BUG", "main"]

EXIT_BUG = 70  # EX_SOFTWARE: an internal error, not the user's


def _one_line(exc: BaseException, command: str | None = None) -> str:
    """A user error's message, also when it crossed a Ray call (``RayTaskError`` carries the
    original as ``cause`` and a traceback in its text), led by the command as every command's
    own checks lead (``stepmem report: …``)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, StepmemError):
        exc = cause
    text = first_line(exc, 10_000)
    if isinstance(exc, UserError) or text.startswith("stepmem"):
        return text
    return f"stepmem {command}: {text}" if command else f"stepmem: {text}"


def main(argv: list[str] | None = None) -> int:
    command = None
    try:
        from collector.cli.subcommands import COMMANDS, build_parser

        parser = build_parser()
        ns = parser.parse_args(argv)
        command = ns.command
        if ns.command is None:  # a bare `stepmem`: what it can do
            parser.print_help()
            return 2
        logging.basicConfig(
            level=logging.INFO if ns.verbose else logging.WARNING,
            format="%(levelname)s %(name)s: %(message)s",
        )
        return COMMANDS[ns.command](ns)
    except StepmemError as exc:
        print(_one_line(exc, command), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stepmem: interrupted", file=sys.stderr)
        return 130
    except Exception:
        import traceback

        traceback.print_exc()
        print(
            "stepmem: internal error: this is a bug in stepmem, not a problem with your input; "
            "please report it with the traceback above",
            file=sys.stderr,
        )
        return EXIT_BUG

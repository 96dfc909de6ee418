"""The ``stepmem`` command: it parses (:mod:`.parsers`) and dispatches (:mod:`.commands`), one row
of :data:`.subcommands.SUBCOMMANDS` a subcommand.

    stepmem run        the main job: samplers on every GPU, a workload under the probe, step table
    stepmem report     a run's per-step table and its diagnosis; compare, baseline, estimate, …

A user error (bad flag, missing capture, unknown GPU: any :class:`StepmemError`) prints one line
and exits 2; never a traceback. Output is a stream the user may close: a closed pipe ends quietly
(exit 141, as a writer that SIGPIPE ends), a full disk is one line and exit 2. Anything else is a
bug in stepmem: its traceback, a line that says so, exit 70.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys

from collector.model.errors import StepmemError, UserError, first_line

__all__ = ["EXIT_BUG", "main"]

EXIT_BUG = 70  # EX_SOFTWARE: an internal error, not the user's
EXIT_PIPE = 128 + 13  # SIGPIPE's status: the output was closed before it was all written
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # an output that cannot take more


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of what could not be written
    raises nothing more."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


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
        rc = COMMANDS[ns.command](ns)
        sys.stdout.flush()  # a closed or full output is said here, not at the interpreter's exit
        return rc
    except StepmemError as exc:
        print(_one_line(exc, command), file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`stepmem report RUN | head`): as git does
        _quiet_stdout()
        return EXIT_PIPE
    except OSError as exc:
        if exc.errno not in _FULL:
            return _bug()
        _quiet_stdout()
        where = f"stepmem {command}" if command else "stepmem"
        print(f"{where}: cannot write its output: {exc.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stepmem: interrupted", file=sys.stderr)
        return 130
    except Exception:
        return _bug()


def _bug() -> int:
    """The exception being handled is stepmem's own: its traceback, and a line saying so."""
    import traceback

    traceback.print_exc()
    print(
        "stepmem: internal error: this is a bug in stepmem, not a problem with your input; "
        "please report it with the traceback above",
        file=sys.stderr,
    )
    return EXIT_BUG

"""How stepmem's long commands stop: the first SIGINT or SIGTERM raises ``KeyboardInterrupt``
in the main thread (whatever the process inherited: a command started in the background of a
shell inherits SIGINT ignored), so ``ray job stop``, a scheduler's kill and Ctrl-C all end a run
or a capture the same way — what was recorded kept."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable

__all__ = ["terminate_as_interrupt"]


def terminate_as_interrupt(echo: Callable[[str], object] = print) -> None:
    """SIGTERM (``ray job stop``, a scheduler's kill) ends the command like Ctrl-C: samplers
    stopped, what was recorded flushed and marked ``interrupted``. Only the first SIGINT or
    SIGTERM does: the ones that follow while it stops (a user pressing Ctrl-C again) are
    answered with a line and otherwise ignored, so the flush and Ray's shutdown are not cut
    short into tracebacks and orphaned processes. SIGKILL still ends it at once (and
    :mod:`collector.reaper` removes a local cluster's processes then)."""
    stopping = False

    def handler(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt(f"signal {signum}")
        # a closed or broken stdout (the reader went away) must not turn the answer into a
        # traceback that cuts the flush short
        with contextlib.suppress(OSError, ValueError):
            echo(
                "stepmem: already stopping (stopping samplers, flushing what was recorded); "
                "kill -9 abandons the flush"
            )

    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

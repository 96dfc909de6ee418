"""Bounds on the work one estimate does, whatever its input names: what the built model may hold
(:func:`bounded_build`: modules and parameters counted as they are made, whatever config key
asked for them) and how long one trace of a spec may run (:func:`time_limited`, the config
path's ``--time-limit``; a script's child is held to the same limit by its parent).

A config is data someone else may have written: ``decoder_layers: 100000`` is a key no list of
layer names knows, and even an allowed size can ask for hours of tracing (each layer costs about
a second of fake-tensor work on two cores). So the model's size is bounded where it is built and
every trace by the clock, each with one line saying which bound it met.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from collector.model.errors import EstimateError

__all__ = ["MAX_MODULES", "MAX_PARAMETERS", "TimeLimit", "bounded_build", "time_limited"]

# A 7B Llama has about 420 modules, a 1,024-layer one about 12,000, a Qwen3-MoE's 128 experts in
# 48 layers about 25,000; building costs about 0.6 ms a module, tracing about a second a layer
# on two cores.
MAX_MODULES = 30_000
MAX_PARAMETERS = 10**13  # 10 T: no released model; bytes are fake, so this bounds nothing real


@contextlib.contextmanager
def bounded_build(what: str) -> Iterator[None]:
    """Modules and parameters counted as they are registered while the block builds a model;
    :class:`EstimateError` (one line naming ``what``) once either passes its bound."""
    import torch.nn.modules.module as mm

    modules = numel = 0

    def on_module(module: object, name: str, sub: object) -> None:
        nonlocal modules
        modules += 1
        if modules > MAX_MODULES:
            raise EstimateError(
                f"{what}: its model has more than {MAX_MODULES:,} modules; at most that many "
                "are traced (a config's layer or expert counts make them)"
            )

    def on_parameter(module: object, name: str, param: Any) -> None:
        nonlocal numel
        if param is not None:
            numel += param.numel()
        if numel > MAX_PARAMETERS:
            raise EstimateError(
                f"{what}: its model has more than {MAX_PARAMETERS:.0e} parameters; at most that "
                "many are traced"
            )

    handles = [
        mm.register_module_module_registration_hook(on_module),
        mm.register_module_parameter_registration_hook(on_parameter),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class TimeLimit(BaseException):
    """A trace ran past its time limit (raised in the tracing thread by :func:`time_limited`):
    not an ``Exception``, so a library's or the trace's own ``except Exception`` lets it by."""


@contextlib.contextmanager
def time_limited(seconds: float, what: str) -> Iterator[None]:
    """The block stopped after ``seconds`` with :class:`EstimateError` naming ``what`` and the
    limit. The clock is the process's real-time timer (``SIGALRM``), so it works only in the
    main thread, where the CLI traces; elsewhere the block runs unbounded. A library that
    swallows the first interruption is interrupted again each second."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def ring(signum: int, frame: object) -> None:
        raise TimeLimit

    before = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    except TimeLimit:
        raise EstimateError(
            f"{what}: not traced within {seconds:.0f} s; stopped (--time-limit SECONDS to "
            "wait longer)"
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)

"""What the script under the estimate says, at its own lines: the error that stopped it
(:func:`describe`: what fake tensors cannot run, a call the estimate does not model — the
stand-in's gap, not the script's error — or the script's own), and torch's warnings shown at
the script's line that caused them (:func:`warnings_at`)."""

from __future__ import annotations

import contextlib
import re
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from collector.estimate.fakes import place
from collector.estimate.script.stand_ins import NotModelled

__all__ = ["describe", "warnings_at"]

_FAKE_ERRORS = (
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "UnsupportedOperatorException",
    "UnsupportedFakeTensorException",
    "GuardOnDataDependentSymNode",
)


def describe(exc: BaseException, script: Path) -> str:
    """The error that stopped the script, named at the script's own line."""
    frames = traceback.extract_tb(exc.__traceback__)
    at = place(frames, script) or script.name
    inner = frames[-1] if frames else None
    where = f" (in {Path(inner.filename).name}:{inner.lineno})" if inner else ""
    text = " ".join(str(exc).split())[:240]
    name = type(exc).__name__
    fake = name in _FAKE_ERRORS or any(
        s in text for s in ("FakeTensor", "fake tensor", "data pointer", "Meta", "meta tensor")
    )
    gap = _stand_in_gap(exc, frames)
    if gap:
        if isinstance(exc, NotModelled):
            return f"{at}: not modelled by the estimate: {gap}"
        return f"{at}: not modelled by the estimate's CPU stand-in for CUDA: {gap} ({name}: {text})"
    what = "cannot run on fake tensors" if fake else "the script raised"
    return f"{at}: {what}: {name}: {text}{where}"


_NO_CUDA = ("_cuda_", "Torch not compiled with CUDA", "dummy base class", "NVML", "pynvml")


def _stand_in_gap(exc: BaseException, frames: Any) -> str:
    """The ``torch.cuda`` function that raised for want of CUDA (a CPU build has none of its C
    parts): the stand-in's gap, not the script's error ("" when it is not one)."""
    text = str(exc)
    if not isinstance(exc, NotModelled) and not any(s in text for s in _NO_CUDA):
        return ""
    if isinstance(exc, NotModelled):
        return text
    dummy = re.search(r"dummy base class (\w+)", text)  # a class a CPU build has no C part of
    if dummy:
        return f"torch.cuda.{dummy.group(1)}"
    inner = [f for f in frames if "/torch/cuda/" in f.filename.replace("\\", "/")]
    return f"torch.cuda.{inner[-1].name}" if inner else ""


_PACKAGE = str(Path(__file__).resolve().parents[2])  # collector/


@contextlib.contextmanager
def warnings_at(script: Path) -> Iterator[None]:
    """A warning torch raises inside the stand-in's or the fake mode's frames (``float(loss)``
    of a tensor that needs grad) is shown at the script's line that caused it, not at
    stepmem's: it is the script's, and stepmem's file name made it look like ours. Costs
    nothing per operation: only a warning being shown walks the stack."""
    import warnings

    shown = warnings.showwarning
    here = str(script.resolve())

    def show(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if str(filename).startswith(_PACKAGE):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename != here:
                frame = frame.f_back
            if frame is not None:
                filename, lineno, line = here, frame.f_lineno, None
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown

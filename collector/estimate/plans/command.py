"""A plan as the command that checks it: :class:`~collector.estimate.request.EstimateFlags`
written back as ``stepmem estimate``'s arguments (each field is the flag of its name), so a
plan printed is exactly the request that was traced — parsed again, it plans the same."""

from __future__ import annotations

import shlex
from dataclasses import fields

from collector.estimate.request import EstimateFlags

__all__ = ["argv", "shell"]

_NOT_WRITTEN = ("script_args", "plan", "keep")  # a plan's command checks one step


def argv(flags: EstimateFlags) -> tuple[str, ...]:
    """``flags`` as ``stepmem estimate``'s arguments (after the command's name), in the
    parser's field order; a flag not given is not written."""
    out: list[str] = []
    for f in fields(EstimateFlags):
        v = getattr(flags, f.name)
        if f.name in _NOT_WRITTEN or v is None or v is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        if v is True:
            out.append(flag)
        else:
            out += [flag, repr(v) if isinstance(v, float) else str(v)]
    if flags.script_args:
        out += ["--", *flags.script_args]
    return tuple(out)


def shell(args: tuple[str, ...]) -> str:
    """The command line a user pastes: ``stepmem estimate`` and ``args``, quoted for a shell."""
    return " ".join(["stepmem", "estimate", *(shlex.quote(a) for a in args)])

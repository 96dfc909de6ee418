"""``stepmem estimate --script FILE -- ARGS``: the user's own training script, unchanged, estimated.

The script runs in a child process (:mod:`.child`) on fake tensors — no GPU memory, the same on
a machine without a GPU — through its first two probe steps (the ``StepProbe`` marks the README
has users add, or the Hugging Face / Lightning callbacks), and is stopped there; the estimate is
the same as ``--config``'s: components per step, module peaks, torch's allocated and reserved
through the caching-allocator model and NVML's figure, and whether it fits the GPU.

* :mod:`.child` — the child: the script under fake tensors, one tracker, the allocation log;
* :mod:`.steps` — the probe's marks cutting the trace into steps;
* :mod:`.counters` — ``torch.cuda``'s memory queries answered from the estimate (counters,
  ``memory_stats``/``memory_summary``, snapshots and their history, the memory fraction);
* :mod:`.cuda_api` — CUDA stood in for by the CPU where there is no GPU, and :mod:`.stand_ins`
  the rest of ``torch.cuda`` there (events, streams, NVTX, RNG state, graphs);
* :mod:`.said` — the script's error and warnings, named at its own line;
* :mod:`.decided` — whether a placeholder (a value read from a fake tensor) decided the figures:
  a script that read values is traced a second time with other placeholders, and compared.

The script's side effects are its own (it may write files and reach the network as when it runs
for real); this process contains it: it runs under stepmem's keeper (:mod:`collector.supervise`:
a process group of its own, ended at the time limit, on Ctrl-C and when this process dies); every
process it starts carries a mark in its environment, and whatever still runs when the estimate
ends — in a session of its own, or left by a keeper that was killed — is ended by that mark
(:mod:`collector.reaper`) and named; nothing of it is read back but the result file, as
untrusted data.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from collector.estimate.request import EstimateRequest
from collector.estimate.script.decided import Trace, decided
from collector.model.errors import EstimateError
from collector.model.prediction import Estimate
from collector.model.untrusted import inert, read_json
from collector.supervise import GRACE_S, supervised

__all__ = ["estimate_script"]

MAX_RESULT_BYTES = 64 << 20
# the environment mark every process of the script inherits (collector.reaper ends them by it)
OWNER = "STEPMEM_ESTIMATE_OWNER"
# the script's environment under the estimate: the Hub off (nothing is fetched: a hub kernel
# could not run on fake tensors anyway, and transformers falls back to torch's own), weights
# loaded in the script's own thread (where the fake mode is)
SCRIPT_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "USE_HUB_KERNELS": "NO",
    "HF_DEACTIVATE_ASYNC_LOAD": "1",
    "PYTHONUNBUFFERED": "1",
}
KILL_GRACE_S = 3.0  # beyond the keeper's own grace


def _root() -> str:
    """The folder ``collector`` is imported from (the child imports the same)."""
    return str(Path(__file__).resolve().parents[3])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """The script and whatever it started: the keeper (:mod:`collector.supervise`) ends their
    group when asked (SIGTERM, then SIGKILL after its grace)."""
    proc.terminate()
    try:
        proc.wait(GRACE_S + KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def estimate_script(
    req: EstimateRequest, progress: Callable[[str], None] | None = None
) -> tuple[Estimate | None, str]:
    """Estimate the script ``req`` names (see the module doc; the request is planned and checked:
    :func:`collector.estimate.request.plan_estimate`). Returns the estimate (None: no step was
    traced) and the error that stopped the script early ("": none); :class:`EstimateError` when
    the script cannot be run or is stopped at its time limit. A script that read values of
    fake tensors runs a second time with other placeholders (:mod:`.decided`): where that
    changes the figures, the estimate says which read decided them (``Estimate.undecided``)."""
    say = progress or (lambda _m: None)
    assert req.script is not None
    script = req.script.path
    if not script.is_file():
        raise EstimateError(f"--script {script}: no such file")
    say(
        f"running {script.name} on fake tensors to the end of its second probe step "
        f"(its output follows; stopped after {req.time_limit:.0f} s)"
    )
    first = _child(req, other=False)
    if first.estimate is None or req.real or not first.answered:
        return first.estimate, first.error
    say(
        f"{script.name} read {first.answered} value(s) of fake tensors, answered with "
        "placeholders: running it again with other placeholders, to see whether one decided "
        "what is allocated"
    )
    est, line = first.estimate, decided(first, _child(req, other=True))
    if not line:
        same = "traced again with other placeholders: the same figures, no placeholder decided them"
        return replace(est, notes=[*est.notes, same]), first.error
    return replace(est, undecided=line), first.error


def _child(req: EstimateRequest, other: bool) -> Trace:
    """One run of the child (the script traced; ``other``: with the second placeholders)."""
    assert req.script is not None
    script, time_limit = req.script.path, req.time_limit
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_root(), env.get("PYTHONPATH")) if p)
    env.update(SCRIPT_ENV)
    env.pop("STEPMEM_ESTIMATE", None)  # the probe's "predicted peak" input, not this
    env.setdefault("PYTHONHASHSEED", "0")  # both traces iterate sets and dicts alike
    token = f"{os.getpid()}-{secrets.token_hex(6)}"
    env[OWNER] = token  # inherited by everything the script starts, whatever session it makes
    with tempfile.TemporaryDirectory(prefix="stepmem-estimate-") as tmp:
        result, req_file = Path(tmp) / "result.json", Path(tmp) / "request.json"
        doc = {"request": req.to_dict(), "result": str(result), "other_placeholders": other}
        req_file.write_text(json.dumps(doc))
        proc = subprocess.Popen(  # under the keeper: a process group of its own, ended with
            # this process even when it is killed outright
            supervised([sys.executable, "-m", "collector.estimate.script.child", str(req_file)]),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr.fileno(),
        )
        try:
            code = proc.wait(time_limit)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise EstimateError(
                f"--script {script.name}: no second probe step within {time_limit:.0f} s; "
                "stopped (--time-limit SECONDS to wait longer; a script needs the probe's "
                "lines, see the README's 'Estimate your own script')"
            ) from None
        except BaseException:  # Ctrl-C: the script goes too
            _stop(proc)
            raise
        finally:
            if proc.poll() is None:
                _stop(proc)
            _reap_left(token)
        return _read(result, code, script)


def _reap_left(token: str) -> None:
    """End every process the script started that is still running — one it put in a session
    of its own (a tracker service, a daemon) escapes the keeper's process group, and one whose
    keeper was killed has no keeper — and say so; name any that could not be ended."""
    import collector.reaper as reaper

    if not reaper.marked(token, OWNER):
        return
    n = reaper.reap(token, grace_s=2.0, settle_s=0.3, most_s=10.0, mark=OWNER)
    left = reaper.marked(token, OWNER)
    print(
        f"stepmem estimate: the script left {n} process(es) running after it; "
        + (
            f"{len(left)} could not be ended (pid {', '.join(map(str, left[:8]))})"
            if left
            else "ended (SIGTERM, then SIGKILL)"
        ),
        file=sys.stderr,
    )


def _read(result: Path, code: int, script: Path) -> Trace:
    """The child's result file, as untrusted data (the script could have written it): bounded,
    strict JSON, shallow (:func:`collector.model.untrusted.read_json`), then checked field by
    field."""
    try:
        d = read_json(result, MAX_RESULT_BYTES, f"--script {script.name}: its result")
    except OSError:
        raise EstimateError(
            f"--script {script.name}: the estimate's process ended (status {code}) before it "
            "wrote a result"
        ) from None
    except ValueError as exc:
        raise EstimateError(str(exc)) from None
    try:
        error = inert(str(d.get("error") or ""))[:1000]
        est = Estimate.from_dict(d["estimate"]) if d.get("estimate") is not None else None
        reads = Trace.reads_from(d.get("reads"))
    except (ValueError, AttributeError, KeyError, TypeError, OverflowError) as exc:
        raise EstimateError(f"--script {script.name}: unreadable result ({exc})") from None
    return Trace(est, error, **reads)

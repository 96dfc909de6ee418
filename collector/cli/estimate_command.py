"""``stepmem estimate``: the flags planned into a request (every check before anything is
traced), the request run, the estimate (and a ``--plan`` search's plans) printed, and the exit
status that says what it found (1: stopped early; 2: nothing traced; 3: nothing fits; 4: a
placeholder decided the figures)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from collector.cli.files import writable_file, write_output
from collector.model.errors import EstimateError, UserError
from collector.model.units import gib

__all__ = ["cmd_estimate"]


def _estimate_out(ns: argparse.Namespace, prog: str) -> Path:
    """``--out``: never the script, config or run it is made from, and never an existing file
    that is not a stepmem estimate (a slip of the shell, ``--out train.py``) unless ``--force``."""
    from collector.model.prediction import load_estimate

    config = ns.config / "config.json" if ns.config and ns.config.is_dir() else ns.config
    out = writable_file(ns.out, "--out", prog, (ns.script, config, ns.like))
    if out.exists() and not ns.force:
        try:
            load_estimate(out)
        except EstimateError:
            raise UserError(
                f"{prog}: --out {ns.out} exists and is not a stepmem estimate; choose another "
                "file, or --force to overwrite it"
            ) from None
    return out


def cmd_estimate(ns: argparse.Namespace) -> int:
    """Plan (every flag checked, before anything is traced), run, print."""
    import torch

    from collector.estimate import build
    from collector.estimate.request import EstimateFlags, plan_estimate
    from collector.estimate.run import run_estimate

    prog = "stepmem estimate"
    build.offline()  # a config is shapes: nothing in it reaches the network
    out = _estimate_out(ns, prog) if ns.out else None
    flags = EstimateFlags.of(ns)
    try:
        like = None
        if flags.like is not None:  # the run's summary, as data: the estimate reads no run
            from collector.analysis.runs import load_meta

            like = load_meta(flags.like).get("workload_summary")
        req = plan_estimate(flags, torch.cuda.is_available(), like)
    except EstimateError as exc:  # a flag's value, file or run: the user's to fix
        raise UserError(f"{prog}: {exc}") from None

    def say(m: str) -> None:
        """Progress, a plain line each on stderr — also to a file or pipe, where a minutes-long
        --max-batch would otherwise look hung in a CI log (--json keeps stderr quiet)."""
        if not ns.json:
            print(f"… {m}", file=sys.stderr, flush=True)

    try:
        outcome = run_estimate(req, progress=say)
    except EstimateError as exc:
        raise UserError(f"{prog}: {exc}") from None
    est = outcome.estimate
    if est is None and outcome.search is not None and req.target is not None:
        first = outcome.search.first
        print(
            f"{prog}: not even {req.search.replace('_', ' ')} {first.value} fits "
            f"{req.target.card.name}: it needs {gib(first.need)} of the "
            f"{gib(req.target.usable)} torch may reserve",
            file=sys.stderr,
        )
        return 3
    if est is not None:
        _print(outcome, ns, out, prog)
    if outcome.error:  # 1: the estimate above is of the steps traced before it; 2: there is none
        kept = " (the estimate above holds the steps traced before it)" if est else ""
        print(f"{prog}: {outcome.error}{kept}", file=sys.stderr)
        return 1 if est is not None else 2
    if est is not None and est.undecided:  # 4: printed, but a placeholder's figures
        print(f"{prog}: not trustworthy: {est.undecided}", file=sys.stderr)
        return 4
    return _plans_said(req, outcome, prog)


def _print(outcome, ns: argparse.Namespace, out: Path | None, prog: str) -> None:
    """The estimate (and a plan search's plans) as text or ``--json``, and to ``--out``."""
    from collector.estimate import render

    est = outcome.estimate
    doc = est.to_dict()
    if outcome.plans is not None:
        doc["plans"] = outcome.plans.to_dict()
    data = json.dumps(doc, indent=1)
    print(data if ns.json else render(est))
    if outcome.plans is not None and not ns.json:
        from collector.estimate.plans.render import render_plans

        print("\n" + render_plans(outcome.plans))
    if out is not None:
        write_output(out, data + "\n", "--out", prog)
        print(f"estimate: {out}  (stepmem report RUN --estimate {out})", file=sys.stderr)


def _plans_said(req, outcome, prog: str) -> int:
    """3 when ``--plan`` found nothing that fits a step that does not; without ``--plan``, a
    step of a spec that does not fit says how to ask for plans."""
    plans, est = outcome.plans, outcome.estimate
    if plans is not None:
        if not plans.fits and not plans.plans:
            print(f"{prog}: no plan found fits {plans.card}", file=sys.stderr)
            return 3
        return 0
    if req.spec is not None and est is not None and est.fit is not None and not est.fit.fits:
        print(
            f"{prog}: it does not fit; add --plan for the changes that do, each traced",
            file=sys.stderr,
        )
    return 0

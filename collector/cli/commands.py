"""The ``stepmem`` command's subcommands: each turns its parsed flags into the library's
options and calls it. Checks of a flag's value live with the flag (:mod:`collector.args`), of a
file the command writes in :mod:`.files`, of a job in :func:`collector.run.job.plan_job`, of an
estimate in :mod:`collector.estimate.spec` — each written once."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from collector import args
from collector.cli.files import check_metrics_addr, check_store, writable_file, write_output
from collector.model.errors import UserError
from collector.model.files import atomic_write
from collector.model.kinds import Gap
from collector.model.settings import JobOptions
from collector.model.units import GIB, gib

__all__ = ["EXIT_INCOMPLETE"]

EXIT_INCOMPLETE = 3  # the run ended, but not everything it measured was kept


def _strip_dashes(argv: list[str]) -> list[str]:
    return argv[1:] if argv and argv[0] == "--" else argv


def _check_run_flags(ns: argparse.Namespace) -> None:
    """Flags that do not go together, and the workload's own arguments, before anything
    starts."""
    import workloads

    if ns.run_command and (ns.script is not None or ns.train_workers):
        other = "--script" if ns.script is not None else "--train-workers"
        raise UserError(f"stepmem run: --command and {other} do not go together")
    if ns.script is not None:
        if not ns.script.is_file():
            raise UserError(f"stepmem run: --script {ns.script}: no such file")
        if ns.train_workers:
            raise UserError("stepmem run: --script and --train-workers do not go together")
    elif ns.run_command:
        import shutil

        if not ns.workload_args:
            raise UserError("stepmem run: --command needs the command after '--'")
        if shutil.which(ns.workload_args[0]) is None:
            raise UserError(f"stepmem run: --command: cannot run {ns.workload_args[0]!r}")
        if ns.workload is not None:
            raise UserError("stepmem run: --command and --workload do not go together")
    else:
        # before anything starts
        workloads.parse(ns.workload or JobOptions.workload, ns.workload_args)
    if ns.remote_write_samples and not ns.remote_write:
        raise UserError("stepmem run: --remote-write-samples needs --remote-write URL")


def _job_options(ns: argparse.Namespace) -> JobOptions:
    """The job the flags describe; what they leave out takes :class:`JobOptions`' defaults."""
    from collector.model.settings import JobOptions

    given = {"captures": ns.captures, "workload": ns.workload}
    return JobOptions(
        backend=ns.backend,
        gpus=ns.gpus,
        speed=ns.speed,
        steps=ns.steps,
        workload_args=ns.workload_args,
        ray_address=ns.address,
        targets=ns.targets,
        sampler=args.sampler_options(ns, run_id=ns.run_id or "", workload=ns.workload_label),
        train_workers=ns.train_workers,
        script=ns.script,
        command=ns.run_command,
        store=None,  # checked, and made, once the plan holds (Plan.with_store)
        **{k: v for k, v in given.items() if v is not None},
    )


def _cmd_run(ns: argparse.Namespace) -> int:
    from collector.replay import resolve_capture
    from collector.run.job import plan_job, run_job

    ns = argparse.Namespace(**{**vars(ns), "workload_args": _strip_dashes(ns.workload_args)})
    _check_run_flags(ns)
    opts = _job_options(ns)
    plan = plan_job(opts)
    replay = plan.spec.kind == "replay"
    stand_ins = ns.run_command or ns.train_workers  # CPU processes bring the steps
    if replay and not stand_ins and (ns.workload is not None or ns.workload_args):
        what = "--workload" if ns.workload is not None else "workload arguments after '--'"
        raise UserError(
            f"stepmem run: {what} choose what runs on a real GPU; the replay backend plays "
            "captures recorded on one (choose them with --capture, e.g. --capture spiky; "
            "--command or --train-workers run CPU processes as stand-ins)"
        )
    check_metrics_addr(ns.metrics_addr, "stepmem run")
    if ns.out is not None:
        caps = tuple(resolve_capture(c) for c in opts.captures) if replay else ()
        writable_file(ns.out, "--out", "stepmem run", (*caps, ns.script))
    if ns.targets is not None:
        writable_file(ns.targets, "--targets", "stepmem run")
    store = check_store(ns.store, ns.run_id or "", ns.no_store)
    result = run_job(plan.with_store(store))
    if ns.out:
        write_output(ns.out, json.dumps(result.document(), indent=1), "--out", "stepmem run")
        print(
            f"step records written to {ns.out}"
            + (f" (the run was {result.status})" if result.status != "complete" else "")
        )
    if result.interrupted is not None:
        raise KeyboardInterrupt from result.interrupted
    if result.failure is not None:
        # The store, records and report are written; the job still fails, as training did.
        print(f"stepmem: {result.failure}", file=sys.stderr)
        return 1
    if result.status == "incomplete":
        print(
            "stepmem: the run ended but its record is incomplete: " + "; ".join(result.problems),
            file=sys.stderr,
        )
        return EXIT_INCOMPLETE
    gpu = [r for r in result.records if not r.has_gap(Gap.STAND_IN)]  # CPU stand-ins: no NVML
    if gpu and not any(r.measured for r in gpu):
        print(
            f"stepmem: none of the run's {len(gpu)} step(s) has an NVML sample, so nothing was "
            "measured on the GPU (steps shorter than the sampling period, or a starved sampler)",
            file=sys.stderr,
        )
        return EXIT_INCOMPLETE
    return 0


def _cmd_baseline(ns: argparse.Namespace) -> int:
    from collector.analysis.baseline import write_baseline

    out = writable_file(ns.out, "--out", "stepmem baseline", (ns.records,))
    name, peak = write_baseline(ns.records, out, ns.workload, ns.merge)
    print(f"baseline for {name}: within-step NVML peak {peak / GIB:.2f} GiB -> {ns.out}")
    return 0


def _cmd_daemon(ns: argparse.Namespace) -> int:
    from collector.backends import BackendSpec
    from collector.daemon import run_daemon, stop_daemon
    from collector.run.job import MAX_REPLAY_GPUS
    from collector.run.ray_session import connect_ray, terminate_as_interrupt

    check_metrics_addr(ns.metrics_addr, "stepmem daemon")
    if ns.gpus is not None and ns.gpus > MAX_REPLAY_GPUS:
        raise UserError(f"stepmem daemon: --gpus {ns.gpus}: at most {MAX_REPLAY_GPUS} per node")
    if ns.targets is not None:
        writable_file(ns.targets, "--targets", "stepmem daemon")
    connect_ray(ns.address or os.environ.get("RAY_ADDRESS") or "auto")
    terminate_as_interrupt()  # SIGTERM stops the daemon loop like Ctrl-C (after ray.init's own)
    if ns.stop:
        print(f"{stop_daemon(ns.targets)} samplers stopped")
        return 0
    spec = BackendSpec(
        ns.backend,
        captures=ns.captures or (["idle"] if ns.backend == "replay" else []),
        gpus=ns.gpus,
    )
    targets = str(ns.targets.resolve()) if ns.targets is not None else ""
    options = args.sampler_options(ns, run_id="daemon", workload="daemon", targets=targets)
    print(
        f"stepmem daemon: {ns.backend} samplers on every GPU node, rescanning every "
        f"{ns.rescan:g} s (Ctrl-C leaves them running; --stop removes them)"
    )
    try:
        run_daemon(spec, options, ns.rescan, ns.targets)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the daemon's normal end
        print("stepmem daemon: stopped; its samplers stay (stepmem daemon --stop removes them)")
    return 0


def _cmd_report(ns: argparse.Namespace) -> int:
    from collector.analysis.report import render_report
    from collector.analysis.runs import load_run

    prog = "stepmem report"
    outs = {}
    for flag in ("out", "png", "html"):  # every output checked before any work starts
        if getattr(ns, flag):
            outs[flag] = writable_file(getattr(ns, flag), f"--{flag}", prog, (ns.run,))
    if (ns.png or ns.html) and not (ns.run.is_dir() or ns.run.name.endswith(".capture.parquet")):
        raise UserError(
            f"{prog}: --png/--html need the trace: a run directory or a capture, not a records file"
        )
    est = None
    if ns.estimate is not None:
        from collector.model.prediction import load_estimate

        est = load_estimate(ns.estimate)  # checked before the run is read
    run = load_run(ns.run)
    text, _ = render_report(run, verbose=ns.detail, all_steps=ns.all_steps, est=est)
    print(text)
    if "out" in outs:
        write_output(outs["out"], text, "--out", prog)
    if ns.png or ns.html:
        _pictures(run, outs, prog)
    return 0


def _pictures(run, outs: dict[str, Path], prog: str) -> None:
    """The timeline as ``--png`` and ``--html`` asked, each written whole or not at all."""
    try:
        from collector.analysis import timeline
    except ImportError as exc:
        raise UserError(f"{prog}: pictures need pip install 'stepmem[report]' ({exc})") from None
    for flag, render, what in (
        ("png", timeline.render_png, "timeline"),
        ("html", timeline.render_html, "interactive timeline"),
    ):
        if flag not in outs:
            continue
        out = outs[flag]
        try:
            atomic_write(out, lambda tmp, render=render: render(run, tmp), same_suffix=True)
        except ImportError as exc:
            raise UserError(
                f"{prog}: pictures need pip install 'stepmem[report]' ({exc})"
            ) from None
        except OSError as exc:
            raise UserError(
                f"{prog}: --{flag} {out} could not be written ({exc.strerror or exc})"
            ) from None
        print(f"{what}: {out}")


def _cmd_compare(ns: argparse.Namespace) -> int:
    from collector.analysis.compare import compare
    from collector.analysis.runs import load_run

    md_path = None
    if ns.markdown:
        md_path = writable_file(ns.markdown, "--markdown", "stepmem compare", (ns.base, ns.new))
    md, regressed = compare(
        load_run(ns.base),
        load_run(ns.new),
        ns.tolerance,
        max_unsampled=ns.max_unsampled,
        other_workload=ns.other_workload,
    )
    print(md)
    if md_path is not None:
        write_output(md_path, md, "--markdown", "stepmem compare")
    return 1 if regressed else 0


def _cmd_dashboards(ns: argparse.Namespace) -> int:
    from collector.dashboards import write_all

    out = Path(ns.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"stepmem dashboards: --out {out} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        try:  # the folder is what --out names: say it, not a file name of the check's
            writable_file(out / ".stepmem-write-test", "--out", "stepmem dashboards")
        except UserError:
            raise UserError(f"stepmem dashboards: --out {out}: cannot write in it") from None
        paths = write_all(out)
    except OSError as exc:
        raise UserError(f"stepmem dashboards: --out {out}: {exc.strerror or exc}") from None
    for path in paths:
        print(path)
    return 0


def _need_nvml(prog: str) -> None:
    """One line, naming the way out, when this machine has no GPU NVML can read."""
    from collector.run.job import nvml_available

    if not nvml_available():
        raise UserError(
            f"{prog}: this machine has no GPU that NVML can read; use --backend replay (it plays "
            "captures recorded on real GPUs)"
        )


def _cmd_devices(ns: argparse.Namespace) -> int:
    if ns.backend != "replay":
        _need_nvml("stepmem devices")
    if ns.calibrate is not None:
        return _calibrate(ns)
    if ns.backend == "replay":
        from collector.replay import ReplayBackend

        backend = ReplayBackend(ns.captures or ["idle"])
    else:
        from collector.nvml import LiveBackend

        backend = LiveBackend()
    for d in backend.devices():
        print(f"{d.index}  {d.uuid}  {d.name}  {d.total_bytes / GIB:.1f} GiB")
    return 0


def _calibrate(ns: argparse.Namespace) -> int:
    if ns.backend == "replay":
        raise UserError(
            "stepmem devices --calibrate measures a real GPU: not with --backend replay"
        )
    from collector.estimate.calibrate import calibrate
    from collector.estimate.gpus import save_calibration

    try:
        c = calibrate(ns.calibrate, say=lambda m: print(m, file=sys.stderr, flush=True))
    except RuntimeError as exc:
        raise UserError(f"stepmem devices --calibrate: {exc}") from None
    path = save_calibration(c)
    print(
        f"{c.gpu}: {gib(c.outside_torch)} outside torch after two training steps "
        f"({gib(c.at_start)} once the CUDA context exists); driver {c.driver}, CUDA {c.cuda}, "
        f"torch {c.torch}; kept in {path}"
    )
    return 0


def _cmd_capture(ns: argparse.Namespace) -> int:
    from collector.capture import record
    from collector.signals import terminate_as_interrupt

    terminate_as_interrupt()  # Ctrl-C and SIGTERM keep what was recorded, however started

    cmd = _strip_dashes(ns.cmd)
    if not cmd and ns.duration is None:
        raise UserError("stepmem capture: give a command after '--' or --duration SECONDS")
    if cmd:
        import shutil

        if shutil.which(cmd[0]) is None:
            why = "not executable" if Path(cmd[0]).exists() else "no such file or command"
            raise UserError(f"stepmem capture: cannot run {cmd[0]!r}: {why}")
    notes = {}
    for item in ns.note:
        if "=" not in item:
            raise UserError(f"stepmem capture: --note {item!r} is not KEY=VALUE")
        k, v = item.split("=", 1)
        notes[k] = v
    writable_file(ns.out, "--out", "stepmem capture")
    if ns.backend == "nvml":
        _need_nvml("stepmem capture")
    backend = None
    if ns.backend == "replay":
        from collector.replay import ReplayBackend, resolve_capture

        for name in ns.captures or ["idle"]:
            src = resolve_capture(name)
            if ns.out.exists() and ns.out.resolve() == src.resolve():
                raise UserError(
                    f"stepmem capture: --out {ns.out} is the capture being resampled; "
                    "write the new capture to another file"
                )
        backend = ReplayBackend(ns.captures or ["idle"])
    cap = record(
        ns.out,
        ns.gpu,
        ns.rate,
        cmd or None,
        ns.duration,
        max_s=ns.max_seconds,
        trim_s=ns.trim,
        notes=notes,
        backend=backend,
    )
    return int(cap.notes.get("returncode", 0) or 0)

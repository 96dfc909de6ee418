"""The ``stepmem`` command.

    stepmem run        the main job: samplers on every GPU, a workload under the probe, step table
    stepmem devices    the GPUs NVML (or a replay) shows on this node, by UUID
    stepmem capture    record an NVML capture on a real GPU while a command runs

A user error (bad flag, missing capture, unknown GPU: any :class:`StepmemError`) prints one line
and exits 2; never a traceback. Anything else is a bug in stepmem: its traceback, a line that says
so, exit 70.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import sys
import tempfile
from pathlib import Path

from collector import args
from collector.errors import StepmemError
from collector.report import EDGE_ROWS
from workloads import WORKLOADS

__all__ = ["main"]

EXIT_BUG = 70  # EX_SOFTWARE: an internal error, not the user's
EXIT_INCOMPLETE = 3  # the run ended, but not everything it measured was kept
MAX_REPLAY_GPUS = 64  # simulated GPUs per node: each is an actor process (~80 MB)
MAX_REPLAY_S = 86_400.0  # a replay that would play longer than a day is a typo in --speed
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class UserError(StepmemError):
    """Something the user can fix: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + line
        raise UserError(f"{self.prog}: {message}")


def _run_parser(sub) -> None:
    r = sub.add_parser("run", help="the main job (replay backend when there is no GPU)")
    args.add_backend(
        r,
        ("auto", "nvml", "replay"),
        "auto",
        help="auto: live NVML when a GPU is present, else replay (default)",
        captures="capture(s) to replay (default: adamw_8bit); repeat for several",
    )
    args.add_sampling(r)
    r.add_argument(
        "--speed",
        type=args.positive_float,
        default=1.0,
        help="replay speed (default 1; at most 1e9)",
    )
    r.add_argument("--steps", type=args.positive_int, help="stop after this many steps (replay)")
    r.add_argument(
        "--workload",
        choices=WORKLOADS,
        help="the workload to run on real GPUs (default finetune; not with replay)",
    )
    r.add_argument(
        "--train-workers",
        type=args.positive_int,
        default=0,
        metavar="N",
        help="run the workload in a Ray Train TorchTrainer with N workers, one GPU each "
        "(live backend; default: in this process, on every GPU it sees)",
    )
    r.add_argument(
        "--script",
        type=Path,
        metavar="TRAIN.py",
        help="run your own training script (one that uses a stepmem probe adapter) instead of "
        "a built-in workload; its arguments go after '--'",
    )
    r.add_argument(
        "--command",
        dest="run_command",
        action="store_true",
        help="run the command after '--' (torchrun …, python -m …) as the workload: every process "
        "it starts with a stepmem probe reports to this run (with the replay backend, as CPU "
        "stand-ins for the replayed GPUs)",
    )
    r.add_argument("--out", type=Path, help="write step records (JSON) here")
    r.add_argument(
        "--address",
        help="Ray cluster address (default: RAY_ADDRESS, else a local cluster on 127.0.0.1)",
    )
    r.add_argument(
        "--run-id", default="", help="the run label on every series (default: time-based)"
    )
    r.add_argument(
        "--store",
        type=Path,
        metavar="DIR",
        help="run store root: the run is written to DIR/<run id> (default: $STEPMEM_STORE, "
        "else runs/; under `ray job submit`, ~/stepmem-runs, as Ray deletes a job's working "
        "directory)",
    )
    r.add_argument("--no-store", action="store_true", help="write no run store")
    r.add_argument(
        "--workload-label",
        default="",
        metavar="NAME",
        help="the workload label on every series, the key of baselines "
        "(default: the workload, or replay:<captures>)",
    )
    r.add_argument(
        "--targets",
        type=Path,
        metavar="FILE",
        help="keep a Prometheus file_sd targets file current while the job runs",
    )
    args.add_metrics(r)
    args.add_remote_write(r)
    r.add_argument(
        "workload_args", nargs=argparse.REMAINDER, help="after '--': arguments for the workload"
    )


def _daemon_parser(sub) -> None:
    dm = sub.add_parser("daemon", help="samplers that stay on every GPU node across jobs")
    dm.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS)")
    args.add_backend(dm, ("nvml", "replay"), "nvml")
    args.add_sampling(dm, window=False)
    dm.add_argument(
        "--rescan",
        type=args.seconds(86_400.0),
        default=30.0,
        help="seconds between scans for new nodes (default 30)",
    )
    dm.add_argument("--targets", type=Path, metavar="FILE", help="keep a file_sd file current")
    args.add_metrics(dm)
    dm.add_argument("--stop", action="store_true", help="remove every stepmem sampler and exit")


def _capture_parser(sub) -> None:
    c = sub.add_parser("capture", help="record NVML on a real GPU while a command runs")
    c.add_argument("--out", type=Path, required=True, help="capture file (.capture.parquet)")
    c.add_argument("--gpu", metavar="UUID", help="GPU to record (default: NVML's first)")
    args.add_backend(
        c,
        ("nvml", "replay"),
        "nvml",
        help="replay: resample a capture instead of reading a real GPU",
        captures="with --backend replay: the capture(s) to resample",
        gpus=False,
    )
    args.add_sampling(c, window=False)
    c.add_argument(
        "--duration", type=args.seconds(86_400.0), help="seconds, when no command is given"
    )
    c.add_argument(
        "--max-seconds",
        type=args.seconds(86_400.0),
        default=600.0,
        help="stop recording (and a command still running) after this long (default 600)",
    )
    c.add_argument(
        "--trim",
        type=args.seconds(86_400.0),
        metavar="SECONDS",
        help="keep only SECONDS before the first and after the last step event",
    )
    c.add_argument("--note", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("cmd", nargs=argparse.REMAINDER, help="after '--': the command to run")


def _baseline_parser(sub) -> None:
    b = sub.add_parser("baseline", help="write a workload's peak baseline as a Prometheus rule")
    b.add_argument("records", type=Path, help="records JSON of an accepted run (run --out)")
    b.add_argument("--out", required=True, help="rule file to write")
    b.add_argument("--workload", help="workload name (default: the records' workload label)")
    b.add_argument("--merge", action="store_true", help="keep other workloads already in --out")


def _report_parser(sub) -> None:
    rp = sub.add_parser("report", help="a run's per-step table and its diagnosis")
    rp.add_argument("run", type=Path, help="run directory (runs/<id>) or records JSON")
    rp.add_argument("--out", help="also write the report text here")
    rp.add_argument("--png", help="write the timeline picture (run directory only)")
    rp.add_argument("--html", help="write an interactive timeline (run directory only)")
    rp.add_argument(
        "--all-steps",
        action="store_true",
        help=f"print every step (a long run shows its first and last {EDGE_ROWS}, its highest "
        "peak and its odd steps)",
    )
    rp.add_argument(
        "--verbose",
        dest="detail",
        action="store_true",
        help="every finding in full, figures under the noise floor (128 MiB or 0.5 %% of the "
        "card) included",
    )
    rp.add_argument(
        "--estimate",
        type=Path,
        metavar="FILE",
        help="put a `stepmem estimate --out` file's prediction beside what was measured, "
        "component by component, and name the differences",
    )


def _compare_parser(sub) -> None:
    cp = sub.add_parser("compare", help="NEW against BASE per GPU and step; exit 1 on regression")
    cp.add_argument("base", type=Path)
    cp.add_argument("new", type=Path)
    cp.add_argument(
        "--tolerance",
        type=args.fraction,
        default=0.05,
        help="allowed growth of the largest within-step peak: 0.05 or 5%% (default); at most "
        "1 (100 %%)",
    )
    cp.add_argument(
        "--max-unsampled",
        type=args.fraction,
        default=0.05,
        help="the share of a run's steps that may lack NVML samples (a loaded machine) and "
        "still be judged, on its other steps: 0.05 or 5%% (default); above it, or when every "
        "step lacks them, the runs cannot be compared",
    )
    cp.add_argument("--markdown", help="write the Markdown (for a PR comment) here")


def _dashboards_parser(sub) -> None:
    g = sub.add_parser("dashboards", help="write the Grafana dashboards (JSON)")
    g.add_argument("--out", default="grafana/dashboards", help="folder for the JSON files")


def _estimate_parser(sub) -> None:
    from collector.estimate import OPTIMS, SHARDS
    from workloads.finetune import SHAPES

    e = sub.add_parser(
        "estimate",
        help="predict a step's memory per component and module before it runs (no GPU memory)",
    )
    e.add_argument(
        "--workload",
        choices=("finetune", "distributed"),
        default="finetune",
        help="finetune: the HF Trainer's step (bf16 autocast, gradient checkpointing, "
        "gradients freed after the step); distributed: workloads/distributed.py's plain loop "
        "(fp32, gradients kept, FSDP2 by default). Default finetune",
    )
    e.add_argument(
        "--shard",
        choices=SHARDS,
        help="distributed: fully_shard every decoder layer and the root (default fsdp2)",
    )
    e.add_argument(
        "--world-size",
        type=args.positive_int,
        default=1,
        metavar="N",
        help="ranks the model is sharded over; one rank is estimated (default 1)",
    )
    model = e.add_mutually_exclusive_group()
    model.add_argument(
        "--size",
        choices=sorted(SHAPES),
        help="the finetune workload's Llama shape (default: 7b on a GPU, tiny elsewhere)",
    )
    model.add_argument(
        "--config",
        type=Path,
        metavar="CONFIG.json",
        help="a Hugging Face config.json (or the folder holding it): any causal LM "
        "transformers builds from a config; read as data, no code from it is run",
    )
    model.add_argument(
        "--like",
        type=Path,
        metavar="RUN",
        help="the model, optimizer and batch of a stored finetune run (its workload summary)",
    )
    e.add_argument("--optim", choices=OPTIMS, help="default: adamw_8bit on a GPU, else adamw_torch")
    e.add_argument(
        "--seq-len",
        type=args.positive_int,
        help="tokens per sequence (default: 4096 on a GPU, 64 elsewhere)",
    )
    e.add_argument("--batch", type=args.positive_int, default=1, help="sequences a micro-batch")
    e.add_argument(
        "--grad-accum",
        type=args.positive_int,
        help="micro-batches a step (default: 2 for finetune, 1 for distributed)",
    )
    e.add_argument("--no-checkpointing", action="store_true", help="without gradient checkpointing")
    e.add_argument("--fp32", action="store_true", help="without bf16 autocast")
    e.add_argument("--out", help="write the estimate (JSON) here, for report --estimate")
    e.add_argument("--json", action="store_true", help="print the estimate as JSON")


def _devices_parser(sub) -> None:
    d = sub.add_parser("devices", help="list GPUs on this node by UUID")
    args.add_backend(d, ("nvml", "replay"), "nvml", gpus=False)


SUBCOMMANDS = (  # in the order `stepmem --help` lists them
    _run_parser,
    _baseline_parser,
    _daemon_parser,
    _report_parser,
    _compare_parser,
    _estimate_parser,
    _dashboards_parser,
    _devices_parser,
    _capture_parser,
)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="stepmem", description="GPU memory inside every training step.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    p.add_argument("--version", action="version", version=f"stepmem {_version()}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stepmem")
    except PackageNotFoundError:
        return "(not installed)"


def _strip_dashes(args: list[str]) -> list[str]:
    return args[1:] if args and args[0] == "--" else args


def writable_file(
    path: Path | str, flag: str, prog: str, inputs: tuple[Path | None, ...] = ()
) -> Path:
    """Refuse an output file that cannot be written, before any work starts: a folder (or a
    name ending in /), a missing folder, a folder this user cannot create files in (tried, not
    guessed: root passes every permission check), something that is not a plain file, and any
    of the command's ``inputs`` or a file inside an input run directory (an output never
    overwrites what it was made from). Returns the path."""
    text = str(path)
    path = Path(path)
    if text.endswith(("/", os.sep)) or path.is_dir():
        raise UserError(f"{prog}: {flag} {text} is a directory, not a file")
    if path.exists() and not path.is_file():
        raise UserError(f"{prog}: {flag} {text} is not a plain file")
    target = path.resolve()
    for src in inputs:
        if src is None or not src.exists():
            continue
        src = src.resolve()
        if target == src or (src.is_dir() and src in target.parents):
            raise UserError(
                f"{prog}: {flag} {text} is {'inside ' if src.is_dir() else ''}an input of this "
                f"command ({src}); write it elsewhere: an output never overwrites its input"
            )
    folder = path.parent
    if not folder.is_dir():
        raise UserError(f"{prog}: {flag} {text}: the folder {folder} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".stepmem-probe-"):
            pass
    except OSError as exc:
        raise UserError(
            f"{prog}: {flag} {text}: cannot write in {folder} ({exc.strerror})"
        ) from None
    return path


def write_output(path: Path, data: str | bytes, flag: str, prog: str) -> None:
    """Write an output file whole or not at all (a temporary file renamed over it): a full
    disk leaves the old file, never a torn one, and is one line, not a traceback."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if isinstance(data, str):
            data = data.encode()
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UserError(
            f"{prog}: {flag} {path} could not be written ({exc.strerror or exc})"
        ) from None


def default_store() -> Path:
    """Where runs go without ``--store``: ``$STEPMEM_STORE``; else, in a job started by ``ray job
    submit`` (its working directory is a copy under Ray's runtime_resources, deleted when Ray
    cleans up), ``~/stepmem-runs``; else ``runs/`` here."""
    if os.environ.get("STEPMEM_STORE"):
        return Path(os.environ["STEPMEM_STORE"])
    submitted = (
        "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ or "runtime_resources" in Path.cwd().parts
    )
    return Path.home() / "stepmem-runs" if submitted else Path("runs")


def _check_store(ns: argparse.Namespace) -> None:
    """The run store root is writable and the run's folder is new (a run never overwrites
    another); ``--run-id`` is a plain name, so the run stays inside ``--store``."""
    if ns.run_id and (not RUN_ID.fullmatch(ns.run_id) or ns.run_id in (".", "..")):
        raise UserError(
            f"stepmem run: --run-id {ns.run_id!r}: a folder name inside --store: letters, "
            "digits, '.', '_' and '-', starting with a letter or digit, at most 128 characters"
        )
    if ns.no_store:
        return
    given = "--store"
    if ns.store is None:
        ns.store = default_store()
        given = "STEPMEM_STORE" if os.environ.get("STEPMEM_STORE") else "the default store"
    where = f"stepmem run: {given} {ns.store}"
    if ns.store.exists() and not ns.store.is_dir():
        raise UserError(f"{where} is a file, not a folder")
    try:
        ns.store.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=ns.store, prefix=".stepmem-probe-"):
            pass
    except OSError as exc:
        raise UserError(f"{where}: cannot write there ({exc.strerror or exc})") from None
    if ns.run_id and (ns.store / ns.run_id).exists():
        raise UserError(
            f"stepmem run: the run store {ns.store / ns.run_id} already exists; choose another "
            "--run-id (or remove that folder): a run never overwrites another"
        )


def _check_metrics_addr(addr: str | None, prog: str) -> None:
    if not addr:
        return
    try:
        socket.getaddrinfo(addr, None)
    except (OSError, UnicodeError) as exc:
        raise UserError(f"{prog}: --metrics-addr {addr!r} does not resolve ({exc})") from None


def _check_ports(base: int, gpus: int, prog: str) -> None:
    if base and base + gpus - 1 > 65535:
        raise UserError(
            f"{prog}: --metrics-port {base} with {gpus} GPUs needs ports up to {base + gpus - 1}; "
            "the largest is 65535"
        )


def _check_replay(ns: argparse.Namespace) -> None:
    """What a replay will play, checked before anything starts."""
    from collector.replay import Capture, resolve_capture

    stand_ins = ns.run_command or ns.train_workers  # CPU processes bring the steps
    if not stand_ins and (ns.workload is not None or ns.workload_args):
        what = "--workload" if ns.workload is not None else "workload arguments after '--'"
        raise UserError(
            f"stepmem run: {what} choose what runs on a real GPU; the replay backend plays "
            "captures recorded on one (choose them with --capture, e.g. --capture spiky; "
            "--command or --train-workers run CPU processes as stand-ins)"
        )
    captures = ns.captures or ["adamw_8bit"]
    gpus = ns.gpus or len(captures)
    if gpus > MAX_REPLAY_GPUS:
        raise UserError(
            f"stepmem run: --gpus {gpus}: at most {MAX_REPLAY_GPUS} simulated GPUs per node "
            "(each is a sampler process); use several nodes for more"
        )
    _check_ports(ns.metrics_port, gpus, "stepmem run")
    longest = 0.0
    for name in captures:
        cap = Capture.load(resolve_capture(name))
        if not cap.events and not stand_ins:
            raise UserError(
                f"stepmem run: capture {name!r} holds no step events, so there are no steps to "
                "replay (idle is for `stepmem daemon --backend replay` and `stepmem devices`)"
            )
        longest = max(longest, cap.duration_ns / 1e9)
    if longest / ns.speed > MAX_REPLAY_S:
        raise UserError(
            f"stepmem run: --speed {ns.speed:g} would play the {longest:.0f} s capture for "
            f"{longest / ns.speed / 3600:.0f} hours; the longest replay is one day"
        )


def _backend_kind(requested: str) -> str:
    if requested != "auto":
        return requested
    from collector.run import nvml_available

    return "nvml" if nvml_available() else "replay"


def _cmd_run(ns: argparse.Namespace) -> int:
    import workloads
    from collector.run import JobOptions, run_job

    ns.workload_args = _strip_dashes(ns.workload_args)
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
        workloads.parse(ns.workload or "finetune", ns.workload_args)  # before anything starts
    kind = _backend_kind(ns.backend)
    if kind == "replay":
        stand_ins = "--command" if ns.run_command else "--train-workers" if ns.train_workers else ""
        if stand_ins and ns.backend == "auto":
            raise UserError(
                f"stepmem run: {stand_ins} needs the live NVML backend (a GPU), and this machine "
                "has none; with --backend replay its CPU processes stand in for the replayed GPUs"
            )
        if ns.script is not None:
            raise UserError(
                "stepmem run: --script needs the live NVML backend (a GPU); the replay backend "
                "plays recorded steps (--command runs a script's processes as CPU stand-ins)"
            )
        _check_replay(ns)
    _check_metrics_addr(ns.metrics_addr, "stepmem run")
    if ns.out is not None:
        from collector.replay import resolve_capture

        caps = tuple(resolve_capture(c) for c in ns.captures or []) if kind == "replay" else ()
        writable_file(ns.out, "--out", "stepmem run", (*caps, ns.script))
    if ns.targets is not None:
        writable_file(ns.targets, "--targets", "stepmem run")
    _check_store(ns)
    if ns.remote_write_samples and not ns.remote_write:
        raise UserError("stepmem run: --remote-write-samples needs --remote-write URL")
    opts = JobOptions(
        backend=kind,
        backend_reason="no GPU here" if ns.backend == "auto" else "asked for",
        captures=ns.captures or ["adamw_8bit"],
        gpus=ns.gpus,
        speed=ns.speed,
        steps=ns.steps,
        workload=ns.workload or "finetune",
        workload_args=ns.workload_args,
        ray_address=ns.address,
        targets=ns.targets,
        sampler=args.sampler_options(ns, run_id=ns.run_id, workload=ns.workload_label),
        train_workers=ns.train_workers,
        script=ns.script,
        command=ns.run_command,
        store=None if ns.no_store else ns.store,
    )
    result = run_job(opts)
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
    return 0


def _cmd_baseline(ns: argparse.Namespace) -> int:
    from collector.baseline import write_baseline

    out = writable_file(ns.out, "--out", "stepmem baseline", (ns.records,))
    name, peak = write_baseline(ns.records, out, ns.workload, ns.merge)
    print(f"baseline for {name}: within-step NVML peak {peak / (1 << 30):.2f} GiB -> {ns.out}")
    return 0


def _cmd_daemon(ns: argparse.Namespace) -> int:
    from collector.backends import BackendSpec
    from collector.daemon import run_daemon, stop_daemon
    from collector.session import connect_ray, terminate_as_interrupt

    _check_metrics_addr(ns.metrics_addr, "stepmem daemon")
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
    options = args.sampler_options(ns, run_id="daemon", workload="daemon")
    if ns.targets is not None:
        options.targets = str(ns.targets.resolve())
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
    from collector.report import render_report
    from collector.runs import load_run

    prog = "stepmem report"
    outs = {}
    for flag in ("out", "png", "html"):  # every output checked before any work starts
        if getattr(ns, flag):
            outs[flag] = writable_file(getattr(ns, flag), f"--{flag}", prog, (ns.run,))
    if (ns.png or ns.html) and not ns.run.is_dir():
        raise UserError(f"{prog}: --png/--html need a run directory (the trace)")
    est = None
    if ns.estimate is not None:
        from collector.estimate import load_estimate

        est = load_estimate(ns.estimate)  # checked before the run is read
    run = load_run(ns.run)
    text, _ = render_report(run, verbose=ns.detail, all_steps=ns.all_steps)
    if est is not None:
        text = text.rstrip("\n") + "\n\n" + _reconciliation(run, est) + "\n"
    print(text)
    if "out" in outs:
        write_output(outs["out"], text, "--out", prog)
    if ns.png or ns.html:
        from collector import timeline
        from collector.store import RunStore

        store = RunStore(ns.run)
        try:
            for flag, render, what in (
                ("png", timeline.render_png, "timeline"),
                ("html", timeline.render_html, "interactive timeline"),
            ):
                if flag in outs:
                    out = outs[flag]  # a temporary name with the same suffix (the format)
                    tmp = out.with_name(f".{out.stem}.{os.getpid()}.tmp{out.suffix}")
                    try:
                        render(run, store, tmp)
                        os.replace(tmp, outs[flag])
                    except OSError as exc:
                        raise UserError(
                            f"{prog}: --{flag} {outs[flag]} could not be written "
                            f"({exc.strerror or exc})"
                        ) from None
                    finally:
                        tmp.unlink(missing_ok=True)
                    print(f"{what}: {outs[flag]}")
        except ImportError as exc:
            raise UserError(
                f"{prog}: pictures need pip install 'stepmem[report]' ({exc})"
            ) from None
    return 0


def _reconciliation(run, est) -> str:
    from collector.estimate import reconcile, render_reconciliation

    parts = []
    for uuid in run.gpus:
        recs = run.by_gpu[uuid]
        pids = [r.pid for r in recs]
        main = max(set(pids), key=pids.count) if pids else 0  # the training process
        rows, named = reconcile(est, [r for r in recs if r.pid == main])
        head = f"GPU {uuid}" + (f", process {main}" if len(set(pids)) > 1 else "")
        parts.append(f"{head}\n{render_reconciliation(est, rows, named)}")
    return "\n\n".join(parts)


def _like(path: Path) -> dict:
    """The finetune arguments a stored run was started with (its workload summary): data,
    checked field by field."""
    from collector.runs import load_run

    meta = load_run(path).meta
    summ = meta.get("workload_summary")
    if not isinstance(summ, dict) or summ.get("workload") != "finetune":
        raise UserError(f"stepmem estimate: --like {path}: not a finetune run with a summary")
    out = {}
    for key, kind in (("size", str), ("optim", str), ("seq_len", int), ("batch", int)):
        v = summ.get(key)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise UserError(f"stepmem estimate: --like {path}: its summary has no {key}")
        out[key] = v
    ga = summ.get("grad_accum", 2)
    out["grad_accum"] = ga if isinstance(ga, int) and not isinstance(ga, bool) else 2
    return out


def _read_config(path: Path) -> dict:
    prog = "stepmem estimate"
    f = path / "config.json" if path.is_dir() else path
    try:
        if f.stat().st_size > 1 << 20:
            raise UserError(f"{prog}: --config {f}: larger than 1 MiB; not a model config")
        cfg = json.loads(f.read_text())
    except OSError as exc:
        raise UserError(f"{prog}: --config {f}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{prog}: --config {f}: not JSON ({exc})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        raise UserError(f"{prog}: --config {f}: a config.json with a model_type")
    if cfg.get("auto_map"):
        raise UserError(
            f"{prog}: --config {f}: its model is custom code (auto_map); stepmem runs no code "
            "from a config"
        )
    return cfg


def _cmd_estimate(ns: argparse.Namespace) -> int:
    import torch

    from collector.estimate import Spec, estimate, render

    prog = "stepmem estimate"
    out = writable_file(ns.out, "--out", prog) if ns.out else None
    gpu = torch.cuda.is_available()
    dist = ns.workload == "distributed"
    if not dist and (ns.shard or ns.world_size != 1):
        raise UserError(f"{prog}: --shard and --world-size are for --workload distributed")
    fields: dict = {
        "workload": ns.workload,
        "optim": ns.optim or ("adamw_8bit" if gpu and not dist else "adamw_torch"),
        "seq_len": ns.seq_len or (4096 if gpu and not dist else 64),
        "batch": ns.batch,
        "grad_accum": ns.grad_accum or (1 if dist else 2),
    }
    if dist:  # workloads/distributed.py's loop
        fields.update(
            shard=ns.shard or "fsdp2", world_size=ns.world_size, keep_grads=True, bf16=False
        )
    if ns.like is not None:
        fields.update(_like(ns.like))
        if ns.optim:
            fields["optim"] = ns.optim
        if ns.seq_len:
            fields["seq_len"] = ns.seq_len
    if ns.config is not None:
        fields.update(size=None, config=_read_config(ns.config))
    elif ns.like is None:
        fields["size"] = ns.size or ("7b" if gpu and not dist else "tiny")
    fields.setdefault("bf16", not ns.fp32)
    spec = Spec(checkpointing=not ns.no_checkpointing and not dist, **fields)
    quiet = ns.json or not sys.stderr.isatty()
    est = estimate(spec, progress=None if quiet else lambda m: print(f"… {m}", file=sys.stderr))
    data = json.dumps(est.to_dict(), indent=1)
    print(data if ns.json else render(est))
    if out is not None:
        write_output(out, data + "\n", "--out", prog)
        print(f"estimate: {out}  (stepmem report RUN --estimate {out})", file=sys.stderr)
    return 0


def _cmd_compare(ns: argparse.Namespace) -> int:
    from collector.compare import compare
    from collector.runs import load_run

    md_path = None
    if ns.markdown:
        md_path = writable_file(ns.markdown, "--markdown", "stepmem compare", (ns.base, ns.new))
    md, regressed = compare(
        load_run(ns.base), load_run(ns.new), ns.tolerance, max_unsampled=ns.max_unsampled
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
        writable_file(out / "stepmem-probe.json", "--out", "stepmem dashboards")
        paths = write_all(out)
    except OSError as exc:
        raise UserError(f"stepmem dashboards: --out {out}: {exc.strerror or exc}") from None
    for path in paths:
        print(path)
    return 0


def _need_nvml(prog: str) -> None:
    """One line, naming the way out, when this machine has no GPU NVML can read."""
    from collector.run import nvml_available

    if not nvml_available():
        raise UserError(
            f"{prog}: this machine has no GPU that NVML can read; use --backend replay (it plays "
            "captures recorded on real GPUs)"
        )


def _cmd_devices(ns: argparse.Namespace) -> int:
    if ns.backend != "replay":
        _need_nvml("stepmem devices")
    if ns.backend == "replay":
        from collector.replay import ReplayBackend

        backend = ReplayBackend(ns.captures or ["idle"])
    else:
        from collector.nvml import LiveBackend

        backend = LiveBackend()
    for d in backend.devices():
        print(f"{d.index}  {d.uuid}  {d.name}  {d.total_bytes / (1 << 30):.1f} GiB")
    return 0


def _cmd_capture(ns: argparse.Namespace) -> int:
    from collector.capture import record

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


def _one_line(exc: BaseException) -> str:
    """A user error's message, also when it crossed a Ray call (``RayTaskError`` carries the
    original as ``cause`` and a traceback in its text)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, StepmemError):
        exc = cause
    text = str(exc).strip().splitlines() or [type(exc).__name__]
    return text[0] if isinstance(exc, UserError) else f"stepmem: error: {text[0]}"


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        ns = parser.parse_args(argv)
        if ns.command is None:  # a bare `stepmem`: what it can do
            parser.print_help()
            return 2
        logging.basicConfig(
            level=logging.INFO if ns.verbose else logging.WARNING,
            format="%(levelname)s %(name)s: %(message)s",
        )
        handler = {
            "run": _cmd_run,
            "devices": _cmd_devices,
            "capture": _cmd_capture,
            "baseline": _cmd_baseline,
            "dashboards": _cmd_dashboards,
            "report": _cmd_report,
            "daemon": _cmd_daemon,
            "compare": _cmd_compare,
            "estimate": _cmd_estimate,
        }
        return handler[ns.command](ns)
    except StepmemError as exc:
        print(_one_line(exc), file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())

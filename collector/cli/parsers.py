"""The ``stepmem`` command's parsers: one function a subcommand (the table that names them, in
``stepmem --help``'s order, is :data:`collector.cli.subcommands.SUBCOMMANDS`); the argument
groups several share are :mod:`collector.args`. A parse error is one line (``stepmem <cmd>:
…``), exit 2."""

from __future__ import annotations

import argparse
from pathlib import Path

from collector import args
from collector.analysis.report import EDGE_ROWS
from collector.model.errors import UserError
from workloads import WORKLOADS

__all__ = ["build_parser"]


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
    _run_outputs(r)
    args.add_metrics(r)
    args.add_remote_write(r)
    r.add_argument(
        "workload_args", nargs=argparse.REMAINDER, help="after '--': arguments for the workload"
    )


def _run_outputs(r) -> None:
    """Where a run goes and what it is called: its records, its cluster, its store, its labels."""
    r.add_argument("--out", type=Path, help="write step records (JSON) here")
    r.add_argument(
        "--address",
        help="Ray cluster address (default: RAY_ADDRESS, else a local cluster on 127.0.0.1)",
    )
    r.add_argument(
        "--run-id",
        type=args.name,
        default=None,
        help="the run label on every series (default: time-based)",
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
    b.add_argument(
        "records",
        type=Path,
        help="an accepted run: its run directory (runs/<id>) or records JSON (run --out)",
    )
    b.add_argument("--out", required=True, help="rule file to write")
    b.add_argument("--workload", help="workload name (default: the records' workload label)")
    b.add_argument("--merge", action="store_true", help="keep other workloads already in --out")


def _report_parser(sub) -> None:
    rp = sub.add_parser("report", help="a run's per-step table and its diagnosis")
    rp.add_argument(
        "run", type=Path, help="run directory (runs/<id>), records JSON (run --out) or a capture"
    )
    rp.add_argument("--out", help="also write the report text here")
    rp.add_argument("--png", help="write the timeline picture (a run directory or a capture)")
    rp.add_argument("--html", help="write an interactive timeline (a run directory or a capture)")
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
    cp.add_argument(
        "--other-workload",
        action="store_true",
        help="judge NEW against a BASE of another workload (their labels differ: finetune, "
        "script:NAME, replay:CAPTURE); without it they cannot be compared",
    )
    cp.add_argument("--markdown", help="write the Markdown (for a PR comment) here")


def _dashboards_parser(sub) -> None:
    g = sub.add_parser("dashboards", help="write the Grafana dashboards (JSON)")
    g.add_argument(
        "--out",
        default="grafana/dashboards",
        help="folder for the JSON files (default: grafana/dashboards under the current folder)",
    )


def _devices_parser(sub) -> None:
    d = sub.add_parser("devices", help="list GPUs on this node by UUID")
    args.add_backend(d, ("nvml", "replay"), "nvml", gpus=False)
    d.add_argument(
        "--calibrate",
        type=int,
        nargs="?",
        const=0,
        metavar="INDEX",
        help="measure what a training process holds on GPU INDEX (default 0) outside torch's "
        "allocator (the CUDA context, kernels loaded on first use) and keep it for estimates "
        "(in $STEPMEM_CALIBRATION, default ~/.config/stepmem/calibration.json); the GPU should "
        "be otherwise idle",
    )


def build_parser(adders) -> argparse.ArgumentParser:
    """The ``stepmem`` parser with a subcommand for each of ``adders`` (the table's order:
    :data:`collector.cli.subcommands.SUBCOMMANDS`)."""
    p = _Parser(prog="stepmem", description="GPU memory inside every training step.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    p.add_argument("--version", action="version", version=f"stepmem {_version()}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    for add in adders:
        add(sub)
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stepmem")
    except PackageNotFoundError:
        return "(not installed)"

"""Command-line argument types and the argument groups several subcommands share, each written
once: a flag's name, default and help live here, and its value becomes a setting of
:mod:`collector.model.settings` in one function.

The types raise ``argparse.ArgumentTypeError`` with a one-line reason; the parser turns it into
``stepmem <cmd>: argument --flag: reason`` (exit 2).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from collector.model.settings import (
    DEFAULT_RATE,
    DEFAULT_WINDOW_S,
    MAX_WINDOW_S,
    Rate,
    SamplerOptions,
    Sampling,
)

if TYPE_CHECKING:  # the exporter is imported only when remote write is asked for
    from collector.export.remote_write import RemoteWriteConfig

__all__ = [
    "add_backend",
    "add_metrics",
    "add_remote_write",
    "add_sampling",
    "fraction",
    "port",
    "positive_float",
    "positive_int",
    "rate",
    "remote_write_config",
    "sampler_options",
    "sampling",
]


def _number(text: str, kind: type, lo: float, hi: float, what: str) -> float:
    """Parse ``text`` as ``kind`` within [lo, hi] for argparse, naming the problem in one line."""
    try:
        v = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not lo <= v <= hi:
        raise argparse.ArgumentTypeError(f"must be in {lo:g}..{hi:g}, got {text}")
    return v


def positive_int(text: str) -> int:
    return int(_number(text, int, 1, float("inf"), "an integer"))


def positive_float(text: str, most: float = 1e9) -> float:
    """A number > 0 and at most ``most`` (a billion by default: nothing stepmem times, counts
    or scales by is meant to be larger, and an overflow later would be a crash, not a line)."""
    v = _number(text, float, 0, float("inf"), "a number")
    if v == 0 or v > most:
        raise argparse.ArgumentTypeError(f"must be > 0 and at most {most:g}, got {text}")
    return v


def seconds(most: float):
    """An argparse type: seconds, > 0 and at most ``most``."""

    def parse(text: str) -> float:
        return positive_float(text, most)

    parse.__name__ = "seconds"
    return parse


def name(text: str) -> str:
    """A name that is given must say something: ``--run-id ""`` was taken as no id at all."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a name, or leave the flag out")
    return text


def port(text: str) -> int:
    return int(_number(text, int, 0, 65535, "a port number"))


def fraction(text: str) -> float:
    """A share: ``0.05`` or ``5%``, from 0 to 1 (100 %). A bare number above 1 is refused, not
    taken as a multiple: ``--tolerance 5`` meaning 500 % would let every regression pass."""
    t = text.strip()
    if t.endswith("%"):
        return _number(t[:-1], float, 0, 100, "a percentage (5% = 0.05)") / 100
    v = _number(t, float, 0, float("inf"), "a number (0.05 = 5 %)")
    if v > 1:
        raise argparse.ArgumentTypeError(
            f"{text} would be {100 * v:g} %; give a share from 0 to 1 ({v / 100:g}) or a "
            f"percentage ({v:g}%)"
        )
    return v


def rate(text: str) -> Rate:
    try:
        return Rate.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# -- groups ---------------------------------------------------------------------------------------


def add_sampling(p: argparse.ArgumentParser, window: bool = True) -> None:
    """``--rate`` (and ``--window``): read back by :func:`sampling`."""
    p.add_argument(
        "--rate",
        type=rate,
        default=DEFAULT_RATE,
        help=f"sampling rate in Hz, or 'max' (default {DEFAULT_RATE.hz:g})",
    )
    if window:
        p.add_argument(
            "--window",
            type=seconds(MAX_WINDOW_S),
            default=DEFAULT_WINDOW_S,
            help="trailing window of the window max/min gauges, seconds "
            f"(default {DEFAULT_WINDOW_S:g})",
        )


def sampling(ns: argparse.Namespace) -> Sampling:
    return Sampling(rate=ns.rate, window_s=getattr(ns, "window", DEFAULT_WINDOW_S))


def add_backend(
    p: argparse.ArgumentParser,
    choices: tuple[str, ...],
    default: str,
    help: str | None = None,
    captures: str = "capture(s) to replay; repeat for several",
    gpus: bool = True,
) -> None:
    """``--backend``, ``--capture`` (repeatable) and ``--gpus`` (simulated GPUs per node)."""
    p.add_argument("--backend", choices=choices, default=default, help=help)
    p.add_argument(
        "--capture", action="append", dest="captures", metavar="NAME|PATH", help=captures
    )
    if gpus:
        p.add_argument("--gpus", type=positive_int, help="simulated GPUs per node (replay)")


def add_metrics(p: argparse.ArgumentParser) -> None:
    """Where each sampler's ``/metrics`` listens."""
    p.add_argument(
        "--metrics-addr",
        metavar="ADDR",
        help="address each sampler's /metrics binds (default: the node's IP; "
        "0.0.0.0 only if you mean all interfaces)",
    )
    p.add_argument(
        "--metrics-port",
        type=port,
        default=0,
        help="port for /metrics (default 0: the OS picks one per sampler); N: the sampler of "
        "GPU i serves on N+i (fixed ports, e.g. for a Kubernetes PodMonitor)",
    )
    p.add_argument(
        "--ray-metrics",
        action="store_true",
        help="also export headline gauges through Ray's own metrics (ray_stepmem_*: what a "
        "Prometheus that scrapes Ray sees with no extra config; Ray exports every ~10 s)",
    )


def add_remote_write(p: argparse.ArgumentParser) -> None:
    rw = p.add_argument_group("remote write (every step pushed with its step-end timestamp)")
    rw.add_argument("--remote-write", metavar="URL", help="e.g. http://127.0.0.1:9090/api/v1/write")
    rw.add_argument(
        "--remote-write-samples",
        action="store_true",
        help="also push the raw NVML trace as per-millisecond maxima",
    )
    rw.add_argument("--remote-write-bearer-token-file", metavar="FILE")
    rw.add_argument("--remote-write-bearer-token-env", metavar="VAR")
    rw.add_argument("--remote-write-basic-user", metavar="USER")
    rw.add_argument("--remote-write-basic-password-file", metavar="FILE")
    rw.add_argument("--remote-write-basic-password-env", metavar="VAR")
    rw.add_argument("--remote-write-ca-file", metavar="FILE")
    rw.add_argument("--remote-write-insecure-skip-verify", action="store_true")


def remote_write_config(ns: argparse.Namespace) -> RemoteWriteConfig | None:
    """The remote write settings, their files checked now (a missing token or CA file fails here,
    in one line); None without ``--remote-write``."""
    if not getattr(ns, "remote_write", None):
        return None
    from collector.export.remote_write import RemoteWriteConfig

    config = RemoteWriteConfig(
        url=ns.remote_write,
        bearer_token_file=ns.remote_write_bearer_token_file,
        bearer_token_env=ns.remote_write_bearer_token_env,
        basic_user=ns.remote_write_basic_user,
        basic_password_file=ns.remote_write_basic_password_file,
        basic_password_env=ns.remote_write_basic_password_env,
        ca_file=ns.remote_write_ca_file,
        insecure_skip_verify=ns.remote_write_insecure_skip_verify,
    )
    config.authorization()
    config.ssl_context()
    return config


def sampler_options(
    ns: argparse.Namespace, run_id: str, workload: str = "", targets: str = ""
) -> SamplerOptions:
    """Every sampler setting of a parsed command line, in one object."""
    return SamplerOptions(
        sampling=sampling(ns),
        run_id=run_id,
        workload=workload,
        targets=targets,
        metrics_addr=ns.metrics_addr,
        metrics_port=ns.metrics_port,
        remote_write=remote_write_config(ns),
        push_samples=getattr(ns, "remote_write_samples", False),
        ray_metrics=getattr(ns, "ray_metrics", False),
    )

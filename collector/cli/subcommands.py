"""The ``stepmem`` subcommands, one table: each its name, the function that adds its parser
(:mod:`.parsers`) and the one that runs it (:mod:`.commands`), in the order ``stepmem --help``
lists them. A subcommand is one row here."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NamedTuple

import collector.cli.commands as c
import collector.cli.estimate_command as ec
import collector.cli.estimate_parser as e
import collector.cli.parsers as p

__all__ = ["COMMANDS", "SUBCOMMANDS", "Subcommand", "build_parser"]


class Subcommand(NamedTuple):
    name: str
    add_parser: Callable[[Any], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS = (
    Subcommand("run", p._run_parser, c._cmd_run),
    Subcommand("baseline", p._baseline_parser, c._cmd_baseline),
    Subcommand("daemon", p._daemon_parser, c._cmd_daemon),
    Subcommand("report", p._report_parser, c._cmd_report),
    Subcommand("compare", p._compare_parser, c._cmd_compare),
    Subcommand("estimate", e.estimate_parser, ec.cmd_estimate),
    Subcommand("dashboards", p._dashboards_parser, c._cmd_dashboards),
    Subcommand("devices", p._devices_parser, c._cmd_devices),
    Subcommand("capture", p._capture_parser, c._cmd_capture),
)
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {s.name: s.run for s in SUBCOMMANDS}


def build_parser() -> argparse.ArgumentParser:
    """The ``stepmem`` parser, a subcommand a row of :data:`SUBCOMMANDS`."""
    return p.build_parser(s.add_parser for s in SUBCOMMANDS)

"""Grafana dashboards: generated from code, checked against the SDK's typed models, naming only
metrics of the table, and every panel query answered by a real Prometheus fed by a replay run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from collector.backends import BackendSpec
from collector.dashboards import DASHBOARDS, build_all, expressions
from collector.export.file_sd import TargetsRefresher
from collector.export.remote_write import RemoteWriteConfig
from collector.metrics import METRICS
from collector.model.prediction import load_estimate
from collector.placement import launch_samplers
from collector.replay import Capture, resolve_capture
from tests.conftest import loopback, wait_for
from tests.prom import Prometheus
from tests.promql import RULES_DIR, metric_names
from tests.replays import replay_steps

pytest.importorskip("grafana_foundation_sdk")
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "grafana" / "dashboards"
PROMETHEUS_OWN = {"up", "ALERTS"}
ESTIMATE = ROOT / "benchmarks" / "results" / "estimate" / "cpu-7b-adamw_8bit.estimate.json"


def committed() -> dict[str, dict]:
    return {name: json.loads((COMMITTED / name).read_text()) for name in DASHBOARDS}


def test_committed_json_is_what_the_code_generates():
    assert sorted(p.name for p in COMMITTED.glob("*.json")) == sorted(DASHBOARDS)
    for name, text in build_all().items():
        assert (COMMITTED / name).read_text() == text, f"regenerate: stepmem dashboards ({name})"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_round_trip_through_the_sdk_model_loses_nothing(name):
    original = committed()[name]
    model = Dashboard.from_json(original)
    again = json.loads(json.dumps(model, cls=JSONEncoder))
    assert again == original


def test_every_expression_names_only_metrics_of_the_table():
    table = {m.name for m in METRICS} | PROMETHEUS_OWN
    for name, model in committed().items():
        exprs = expressions(model)
        assert len(exprs) >= 8, name
        for expr in exprs:
            inner = re.sub(r"label_values\((.*),\s*\w+\)$", r"\1", expr)
            named = metric_names(inner)  # and those a variable's __name__ matcher lists
            for alts in re.findall(r'__name__=~"([^"]+)"', inner):
                named |= set(alts.split("|"))
            assert named and named <= table, (name, expr, named - table)


def test_every_panel_has_a_unit_and_a_description():
    for name, model in committed().items():
        for panel in model["panels"]:
            if panel["type"] == "row":
                continue
            assert panel.get("description"), (name, panel["title"])
            assert panel["fieldConfig"]["defaults"].get("unit"), (name, panel["title"])


def test_provisioning_points_at_the_dashboards():
    ds = yaml.safe_load((ROOT / "grafana/provisioning/datasources/stepmem.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    prov = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/stepmem.yml").read_text())
    assert prov["providers"][0]["type"] == "file"


def substitute(expr: str, run: str) -> str:
    """What Grafana sends for this expression with the variables chosen (all GPUs of one run)."""
    expr = re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", expr)
    for var, value in (
        ("$run", run),
        ("$node", ".*"),
        ("$gpu", ".*"),
        ("$rank", ".*"),
        ("$__rate_interval", "1m"),
        ("$__interval", "1m"),
    ):
        expr = expr.replace(var, value)
    return expr


@pytest.mark.ray
def test_every_panel_query_returns_data_from_a_replay_run(kill_samplers, tmp_path):
    prom = Prometheus(tmp_path)
    cfg = yaml.safe_load(prom.config.read_text())
    cfg["global"]["evaluation_interval"] = "1s"
    cfg["rule_files"] = [str(RULES_DIR / "stepmem.yml"), str(RULES_DIR / "baselines.yml")]
    prom.config.write_text(yaml.safe_dump(cfg))
    prom.start()
    refresher = None
    try:
        run = "t-dashboards"
        cap = Capture.load(resolve_capture("adamw_8bit"))
        # as a probe given the committed estimate of this run (STEPMEM_ESTIMATE) sends them
        peak = load_estimate(ESTIMATE).peak
        cap.events = [dict(e, estimate_peak=peak) if e.get("ledger") else e for e in cap.events]
        rw = RemoteWriteConfig(url=f"{prom.url}/api/v1/write", flush_interval_s=0.2)
        speed = 4.0
        placed = launch_samplers(
            BackendSpec("replay", captures=["adamw_8bit"], gpus=2, speed=speed),
            loopback(run_id=run, workload="finetune", remote_write=rw, push_samples=True),
        )
        kill_samplers.extend(p.handle for p in placed)
        refresher = TargetsRefresher(
            prom.targets / "stepmem.json", [p.handle for p in placed], interval_s=1.0
        )
        wait_for(lambda: prom.scalar(f'sum(up{{job="stepmem", run="{run}"}})') == 2, timeout=40)
        replay_steps(placed, cap, 5, speed)
        # One malformed event: a real reason for an alert, so the alerts panel has data too.
        placed[0].handle.record_events.remote([{"kind": "bogus"}])
        wait_for(lambda: prom.query('ALERTS{alertname="StepMemEventsDropped"}'), timeout=40)
        wait_for(
            lambda: (
                prom.scalar(
                    f'count(count_over_time(stepmem_step{{job="stepmem-steps", run="{run}"}}[10m]))'
                )
                == 2
            ),
            timeout=30,
        )
        empty = []
        for name, model in committed().items():
            for expr in expressions(model):
                if not prom.query(substitute(expr, run)):
                    empty.append((name, expr))
        assert empty == []
    finally:
        if refresher is not None:
            refresher.stop()
        prom.stop()


@pytest.mark.ray
def test_a_run_that_only_pushed_by_remote_write_is_in_the_run_node_and_gpu_lists(
    kill_samplers, tmp_path
):
    """No scrape target at all: the run's step series reached Prometheus by remote write only,
    and the dashboards' variables (what Grafana asks: label values on their selectors) list it."""
    prom = Prometheus(tmp_path).start()
    try:
        run = "t-pushed-only"
        cap = Capture.load(resolve_capture("adamw_8bit"))
        rw = RemoteWriteConfig(url=f"{prom.url}/api/v1/write", flush_interval_s=0.2)
        speed = 4.0
        placed = launch_samplers(
            BackendSpec("replay", captures=["adamw_8bit"], gpus=2, speed=speed),
            loopback(run_id=run, workload="finetune", remote_write=rw),
        )
        kill_samplers.extend(p.handle for p in placed)
        replay_steps(placed, cap, 2, speed)
        wait_for(
            lambda: prom.scalar(f'count(stepmem_step{{job="stepmem-steps", run="{run}"}})') == 2,
            timeout=30,
        )
        assert prom.query(f'up{{run="{run}"}}') == []  # never scraped
        model = committed()["stepmem-step-memory.json"]
        found = {}
        for var in model["templating"]["list"]:
            m = re.match(r"^label_values\((.*),\s*(\w+)\)$", var.get("query") or "")
            if m:
                sel = m.group(1).replace("$run", run).replace("$node", ".*")
                found[var["name"]] = prom.label_values(m.group(2), sel)
        gpus = {p.gpu_uuid for p in placed}
        assert run in found["run"] and found["node"] and gpus <= set(found["gpu"])
    finally:
        prom.stop()

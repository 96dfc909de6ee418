"""The metric table and the scrape-time collector (fresh registry per test, one golden file)."""

import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from collector.export.prometheus import SamplerCollector, Snapshot
from collector.metrics import METRICS, PUSHED, by_name
from collector.model.series import Metric, step_values
from collector.model.step import StepRecord
from tests.prom import CONFIG, require
from tests.records import step_record as record
from tests.records import step_record_data

GOLDEN = Path(__file__).parent / "golden" / "metrics.txt"
LABELS = {"node": "n1", "gpu": "0", "gpu_uuid": "GPU-abc", "run": "r1", "workload": "w"}
GIB = 1 << 30


def snapshot(**kw):
    base = dict(
        labels=LABELS,
        total_bytes=140 * GIB,
        used_bytes=81 * GIB,
        reserved_bytes=615 << 20,
        window_s=15.0,
        window_max_bytes=82 * GIB,
        window_min_bytes=80 * GIB,
        last_records=[record()],
        samples_total=123456,
        errors={"unknown": 3},
        missed_deadlines=4,
        dropped={"malformed": 1},
        rate_hz=999.5,
        target_rate_hz=1000.0,
        up=True,
        steps_joined=7,
        remote_write={"sent": 70, "pending": 0, "dropped": {"buffer_full": 2}},
        processes={"train_rank_0": 80 * GIB, "other": 2 * GIB},
    )
    base.update(kw)
    return Snapshot(**base)


def registry_with(*snaps):
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SamplerCollector(lambda: list(snaps)))
    return reg


def test_values_are_read_at_scrape_time():
    reg = registry_with(snapshot())
    v = reg.get_sample_value
    step = {**LABELS, "rank": "0"}  # a step is one rank's
    assert v("stepmem_step_nvml_peak_bytes", step) == 82 * GIB
    assert v("stepmem_step_nontorch_bytes", step) == GIB - (600 << 20)
    assert v("stepmem_step_ledger_bytes", {**step, "kind": "optimizer_state"}) == 13 * GIB
    assert v("stepmem_nvml_used_window_max_bytes", LABELS) == 82 * GIB
    assert v("stepmem_sampler_errors_total", {**LABELS, "kind": "unknown"}) == 3
    assert v("stepmem_torch_alloc_retries_total", step) == 2
    assert v("stepmem_step_duration_seconds", step) == 1.5
    assert v("stepmem_remote_write_dropped_total", {**LABELS, "reason": "buffer_full"}) == 2


def test_ranks_sharing_a_gpu_each_have_their_series():
    two = [
        StepRecord.from_dict({**step_record_data(), "rank": 0, "world_size": 2, "pid": 10}),
        StepRecord.from_dict(
            {**step_record_data(), "rank": 1, "world_size": 2, "pid": 11, "step": 9}
        ),
    ]
    reg = registry_with(snapshot(last_records=two))
    assert reg.get_sample_value("stepmem_step", {**LABELS, "rank": "0"}) == record().step
    assert reg.get_sample_value("stepmem_step", {**LABELS, "rank": "1"}) == 9


def test_golden_exposition():
    text = generate_latest(registry_with(snapshot())).decode()
    assert text == GOLDEN.read_text()


def test_every_exported_family_is_in_the_table():
    text = generate_latest(registry_with(snapshot())).decode()
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    table = {m.name for m in METRICS}
    assert {n if n in table else n + "_total" for n in names} <= table
    assert len(names) >= 25


def test_pushed_and_step_series_are_in_the_table():
    for name in PUSHED:
        assert by_name(name).type == "gauge"
    assert {name for name, _, _ in step_values(record(), pushed_only=True)} <= set(PUSHED)
    pull_only = {name for name, _, _ in step_values(record())} - set(PUSHED)
    assert pull_only == {
        "stepmem_step_gap",
        "stepmem_torch_alloc_retries_total",
        "stepmem_torch_ooms_total",
    }
    with pytest.raises(KeyError, match="not in stepmem's metric table"):
        by_name("stepmem_made_up_bytes")


def test_no_label_is_unbounded():
    for m in METRICS:
        assert not {"step", "timestamp", "t_ns", "time"} & set(m.labels), m.name


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(name="x_total", type="gauge", unit=""), "counters, and only counters"),
        (dict(name="x", type="counter", unit=""), "counters, and only counters"),
        (dict(name="x_bytes_used", type="gauge", unit="bytes"), "_bytes"),
        (dict(name="x", type="summary", unit=""), "gauge or counter"),
    ],
)
def test_table_entries_are_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        Metric(help="h", **kw)


def test_a_broken_snapshot_never_breaks_the_scrape():
    def boom():
        raise RuntimeError("sampler state unreadable")

    reg = CollectorRegistry(auto_describe=False)
    reg.register(SamplerCollector(boom))
    assert generate_latest(reg) == b""
    bad = snapshot(labels={"node": "n1"})  # missing labels: skipped, the good one still served
    text = generate_latest(registry_with(bad, snapshot())).decode()
    assert 'gpu_uuid="GPU-abc"' in text


def test_before_any_step_only_live_series_are_exported():
    reg = registry_with(snapshot(last_records=[], remote_write={}))
    assert reg.get_sample_value("stepmem_nvml_used_bytes", LABELS) == 81 * GIB
    assert reg.get_sample_value("stepmem_step", LABELS) is None


def test_project_prometheus_config_passes_promtool():
    res = subprocess.run(
        [require("promtool"), "check", "config", str(CONFIG)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout + res.stderr

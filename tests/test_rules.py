"""Alert rules: each alert fires on a series that should fire it and stays silent on one that
should not (``promtool test rules``), rules and Alertmanager config pass their checkers, and every
rule names only metrics of the metric table.

The promtool test file ``deploy/prometheus/rules-tests.yml`` is generated from :data:`CASES`
(expected annotations are the rule's templates filled with the alert's labels) and committed, so
``promtool test rules deploy/prometheus/rules-tests.yml`` works without Python (beside the
rules, not among them: ``promtool check rules rules/*.yml`` checks every rule file); a test
keeps the committed file equal to the generated one.
"""

from __future__ import annotations

import re
import subprocess
import time

import yaml

from collector.metrics import METRICS
from tests.cli import one_line_error, stepmem
from tests.prom import require
from tests.promql import RULES_DIR, metric_names
from tests.records import RECORDS, ROOT

ALERTMANAGER = RULES_DIR.parent.parent / "alertmanager" / "alertmanager.yml"
GIB = 1 << 30
MIB = 1 << 20

GPU = {"node": "n1", "gpu": "0", "gpu_uuid": "GPU-a", "run": "r1", "workload": "finetune"}
SCRAPED = {**GPU, "job": "stepmem", "instance": "127.0.0.1:9400"}
PUSHED = {**GPU, "job": "stepmem-steps", "rank": "0"}


def rank(r: int) -> dict[str, str]:
    """Pushed per-step labels of rank ``r`` of a 4-rank run, one GPU each."""
    return {**GPU, "gpu": str(r), "gpu_uuid": f"GPU-{r}", "job": "stepmem-steps", "rank": str(r)}


SEED_RESERVED = f"{int(68.65 * GIB)} {int(81.30 * GIB)} {int(81.79 * GIB)}x60"  # the seed, unpaged

# (alert, input series {name: (labels, values)}, eval time, expected alert labels or None)
CASES: list[tuple[str, str, dict[str, tuple[dict, str]], str, dict | None]] = [
    (
        "peak above 95 % of the card",
        "StepMemPeakNearCapacity",
        {
            "stepmem_nvml_used_window_max_bytes": (SCRAPED, f"{int(0.97 * 140 * GIB)}x10"),
            "stepmem_nvml_total_bytes": (SCRAPED, f"{140 * GIB}x10"),
        },
        "5m",
        SCRAPED,
    ),
    (
        "the seed's 82.5 of 140 GiB",
        "StepMemPeakNearCapacity",
        {
            "stepmem_nvml_used_window_max_bytes": (SCRAPED, f"{int(82.53 * GIB)}x10"),
            "stepmem_nvml_total_bytes": (SCRAPED, f"{140 * GIB}x10"),
        },
        "5m",
        None,
    ),
    (
        "reserved leaking 100 MiB a minute",
        "StepMemReservedGrowing",
        {"stepmem_step_torch_reserved_end_bytes": (PUSHED, f"{80 * GIB}+{100 * MIB}x60")},
        "45m",
        PUSHED,
    ),
    (
        "the seed's step-2 jump, then flat",
        "StepMemReservedGrowing",
        {"stepmem_step_torch_reserved_end_bytes": (PUSHED, SEED_RESERVED)},
        "45m",
        None,
    ),
    (
        "NVML leaking 100 MiB a minute",
        "StepMemNvmlGrowing",
        {"stepmem_step_nvml_end_bytes": (PUSHED, f"{80 * GIB}+{100 * MIB}x60")},
        "45m",
        PUSHED,
    ),
    (
        "NVML with the seed's jump, then flat",
        "StepMemNvmlGrowing",
        {"stepmem_step_nvml_end_bytes": (PUSHED, SEED_RESERVED)},
        "45m",
        None,
    ),
    (
        "memory outside torch leaking",
        "StepMemNonTorchGrowing",
        {"stepmem_step_nontorch_bytes": (PUSHED, f"{GIB}+{300 * MIB}x60")},
        "40m",
        PUSHED,
    ),
    (
        "paged optimizer state appearing at step 1, then flat",
        "StepMemNonTorchGrowing",
        {"stepmem_step_nontorch_bytes": (PUSHED, f"{int(0.14 * GIB)} {int(13.52 * GIB)}x60")},
        "40m",
        None,
    ),
    (
        "peak 10 % above the finetune baseline",
        "StepMemPeakRegression",
        {"stepmem_step_nvml_peak_bytes": (PUSHED, f"{int(1.10 * 88620204032)}x20")},
        "10m",
        {k: GPU[k] for k in ("workload", "run", "node", "gpu_uuid")},
    ),
    (
        "peak at the baseline",
        "StepMemPeakRegression",
        {"stepmem_step_nvml_peak_bytes": (PUSHED, "88620204032x20")},
        "10m",
        None,
    ),
    (
        "allocator retries",
        "StepMemAllocRetries",
        {"stepmem_torch_alloc_retries_total": (SCRAPED, "0 0 0 1 1 1")},
        "5m",
        SCRAPED,
    ),
    (
        "no allocator retries",
        "StepMemAllocRetries",
        {"stepmem_torch_alloc_retries_total": (SCRAPED, "0x10")},
        "5m",
        None,
    ),
    ("an OOM", "StepMemOOM", {"stepmem_torch_ooms_total": (SCRAPED, "0 0 1 1")}, "3m", SCRAPED),
    ("no OOM", "StepMemOOM", {"stepmem_torch_ooms_total": (SCRAPED, "0x10")}, "3m", None),
    ("target down", "StepMemSamplerDown", {"up": (SCRAPED, "0x10")}, "5m", SCRAPED),
    ("target up", "StepMemSamplerDown", {"up": (SCRAPED, "1x10")}, "5m", None),
    (
        "sampling thread stopped",
        "StepMemSamplerStopped",
        {"stepmem_sampler_up": (SCRAPED, "0x10")},
        "5m",
        SCRAPED,
    ),
    (
        "sampling thread running",
        "StepMemSamplerStopped",
        {"stepmem_sampler_up": (SCRAPED, "1x10")},
        "5m",
        None,
    ),
    (
        "half the target rate",
        "StepMemSamplerSlow",
        {
            "stepmem_sampler_rate_hz": (SCRAPED, "500x15"),
            "stepmem_sampler_target_rate_hz": (SCRAPED, "1000x15"),
        },
        "10m",
        SCRAPED,
    ),
    (
        "99.5 % of the target rate",
        "StepMemSamplerSlow",
        {
            "stepmem_sampler_rate_hz": (SCRAPED, "995x15"),
            "stepmem_sampler_target_rate_hz": (SCRAPED, "1000x15"),
        },
        "10m",
        None,
    ),
    (
        "'max' has no target to miss",
        "StepMemSamplerSlow",
        {
            "stepmem_sampler_rate_hz": (SCRAPED, "90000x15"),
            "stepmem_sampler_target_rate_hz": (SCRAPED, "0x15"),
        },
        "10m",
        None,
    ),
    (
        "NVML errors",
        "StepMemSamplerErrors",
        {"stepmem_sampler_errors_total": ({**SCRAPED, "kind": "unknown"}, "0 0 5 5")},
        "3m",
        {**SCRAPED, "kind": "unknown"},
    ),
    (
        "no NVML errors",
        "StepMemSamplerErrors",
        {"stepmem_sampler_errors_total": ({**SCRAPED, "kind": "unknown"}, "0x10")},
        "3m",
        None,
    ),
    (
        "malformed events",
        "StepMemEventsDropped",
        {"stepmem_sampler_dropped_total": ({**SCRAPED, "reason": "malformed"}, "0 0 3 3")},
        "3m",
        {**SCRAPED, "reason": "malformed"},
    ),
    (
        "no dropped events",
        "StepMemEventsDropped",
        {"stepmem_sampler_dropped_total": ({**SCRAPED, "reason": "malformed"}, "0x10")},
        "3m",
        None,
    ),
    (
        "remote write buffer overflowing",
        "StepMemRemoteWriteDropping",
        {"stepmem_remote_write_dropped_total": ({**SCRAPED, "reason": "buffer_full"}, "0 0 10")},
        "2m",
        {**SCRAPED, "reason": "buffer_full"},
    ),
    (
        "rank 1 of 4 holds 3 GiB (7.5 %) more than the others",
        "StepMemRankImbalance",
        {
            f"stepmem_step_torch_allocated_peak_bytes@{r}": (
                rank(r),
                f"{(40 + (3 if r == 1 else 0)) * GIB}x30",
            )
            for r in range(4)
        },
        "15m",
        rank(1),
    ),
    (
        "4 ranks within 1 % of each other",
        "StepMemRankImbalance",
        {
            f"stepmem_step_torch_allocated_peak_bytes@{r}": (rank(r), f"{40 * GIB + r * MIB}x30")
            for r in range(4)
        },
        "15m",
        None,
    ),
    (
        "one process: no ranks to compare",
        "StepMemRankImbalance",
        {"stepmem_step_torch_allocated_peak_bytes": (PUSHED, f"{40 * GIB}x30")},
        "15m",
        None,
    ),
    (
        "remote write healthy",
        "StepMemRemoteWriteDropping",
        {"stepmem_remote_write_dropped_total": ({**SCRAPED, "reason": "buffer_full"}, "0x10")},
        "2m",
        None,
    ),
]


def alert_rules() -> dict[str, dict]:
    doc = yaml.safe_load((RULES_DIR / "stepmem.yml").read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


def fill(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels[m.group(1)], template)


def series(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def generated_tests() -> str:
    rules = alert_rules()
    tests = []
    for title, alert, inputs, at, expected in CASES:
        exp = []
        if expected is not None:
            rule = rules[alert]
            labels = {**expected, **rule["labels"]}
            exp = [
                {
                    "exp_labels": labels,
                    "exp_annotations": {k: fill(v, labels) for k, v in rule["annotations"].items()},
                }
            ]
        tests.append(
            {
                "name": f"{alert}: {title}",
                "interval": "1m",
                "input_series": [  # "name@k": the k-th series of one metric
                    {"series": series(n.split("@")[0], lab), "values": v}
                    for n, (lab, v) in inputs.items()
                ],
                "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": exp}],
            }
        )
    doc = {
        "rule_files": ["rules/stepmem.yml", "rules/baselines.yml"],
        "evaluation_interval": "1m",
        "tests": tests,
    }
    header = "# Generated by tests/test_rules.py from its CASES; do not edit by hand.\n"
    return header + yaml.safe_dump(doc, sort_keys=False, width=1000)


def test_committed_promtool_tests_match_the_cases():
    assert (RULES_DIR.parent / "rules-tests.yml").read_text() == generated_tests()


def test_every_alert_fires_and_stays_silent_somewhere():
    fired = {alert for _, alert, _, _, exp in CASES if exp is not None}
    silent = {alert for _, alert, _, _, exp in CASES if exp is None}
    assert fired == silent == set(alert_rules())


def test_promtool_test_rules_passes():
    res = subprocess.run(
        [require("promtool"), "test", "rules", "rules-tests.yml"],
        cwd=RULES_DIR.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("SUCCESS") >= 1


def test_promtool_check_rules_passes():
    """F18: the obvious glob, every file in rules/ (the unit tests live beside it, not in it)."""
    files = sorted(p.name for p in RULES_DIR.glob("*.yml"))
    assert files == ["baselines.yml", "stepmem.yml"]
    res = subprocess.run(
        [require("promtool"), "check", "rules", *files],
        cwd=RULES_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_alertmanager_config_passes_amtool():
    res = subprocess.run(
        [require("amtool"), "check-config", str(ALERTMANAGER)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_rule_has_severity_description_and_runbook():
    for name, rule in alert_rules().items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert {"summary", "description", "runbook"} <= rule["annotations"].keys(), name


PROMETHEUS_OWN = {"up"}


def test_rules_name_only_metrics_of_the_table():
    table = {m.name for m in METRICS} | PROMETHEUS_OWN
    for path in (RULES_DIR / "stepmem.yml", RULES_DIR / "baselines.yml"):
        doc = yaml.safe_load(path.read_text())
        for group in doc["groups"]:
            for rule in group["rules"]:
                names = metric_names(rule["expr"])
                assert names <= table, (rule.get("alert") or rule.get("record"), names - table)
                if "record" in rule:
                    assert rule["record"] in table


def test_baseline_never_overwrites_a_file_that_is_not_a_baseline(tmp_path, record_fault):
    rules = ROOT / "deploy" / "prometheus" / "rules" / "stepmem.yml"
    other = tmp_path / "alerts.yml"
    other.write_text(rules.read_text())
    broken = tmp_path / "broken.yml"
    broken.write_text("groups: [unclosed\n")
    lines = {}
    for target, merge, needle in (
        (broken, True, "not a stepmem baseline file"),
        (other, False, "not a stepmem baseline file"),
        (other, True, "not a stepmem baseline file"),
    ):
        before = target.read_text()
        args = ["baseline", str(RECORDS), "--out", str(target), "--workload", "finetune"]
        args += ["--merge"] if merge else []
        lines[target.name] = one_line_error(stepmem(*args), needle)
        assert target.read_text() == before
    for name, what in (("broken.yml", "INVALID.yml"), ("alerts.yml", "ALERT_RULES.yml")):
        record_fault(
            f"bad input: stepmem baseline RECORDS --merge --out {what}",
            f"{lines[name]} — the file is left byte for byte as it was",
        )
    # a baseline file with another workload: kept with --merge, refused without it
    mine = tmp_path / "baselines.yml"
    assert stepmem("baseline", str(RECORDS), "--out", str(mine), "--workload", "a").returncode == 0
    one_line_error(
        stepmem("baseline", str(RECORDS), "--out", str(mine), "--workload", "b"), "--merge"
    )
    res = stepmem("baseline", str(RECORDS), "--out", str(mine), "--workload", "b", "--merge")
    assert res.returncode == 0
    from collector.analysis.baseline import read_rules

    assert sorted(read_rules(mine)) == ["a", "b"]


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path, record_fault):
    bomb = tmp_path / "laughs.yml"
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for x, y in zip("bcdefgh", "abcdefg", strict=True):
        lines.append(f"{x}: &{x} [" + ",".join([f"*{y}"] * 9) + "]")
    bomb.write_text("\n".join(lines) + "\n")
    before = bomb.read_bytes()
    t0 = time.monotonic()
    res = stepmem("baseline", str(RECORDS), "--out", str(bomb), "--merge", "--workload", "x")
    line = one_line_error(res, "not a stepmem baseline file", "aliases")
    assert time.monotonic() - t0 < 30 and bomb.read_bytes() == before
    record_fault("hostile input: a YAML alias bomb as baseline --merge --out", line,
                 seconds=round(time.monotonic() - t0, 1))  # fmt: skip


def test_baseline_takes_a_run_directory_as_report_does(tmp_path):
    """N16: the run store a run keeps by default gives the same baseline as its records."""
    from collector.analysis.baseline import write_baseline

    run = ROOT / "benchmarks/results/fit/runs/h200-fit-gpt2"
    name, peak = write_baseline(run, tmp_path / "b.yml", None, merge=False)
    assert name == "script:fit_loop" and abs(peak / (1 << 30) - 29.12) < 0.01

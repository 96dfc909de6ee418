"""Several Ray nodes for real: ``ray.cluster_utils.Cluster`` on loopback (a head and two
workers, each its own raylet) with two replayed GPUs on each, the main job running against it,
and a worker node removed mid-run. Runs ``benchmarks/multinode.py`` in a process of its own (a
process holds one Ray connection; the session's local cluster is another)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def multinode(tmp_path_factory):
    out = tmp_path_factory.mktemp("multinode")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "multinode.py"), "--nodes", "3"]
    cmd += ["--gpus", "2", "--speed", "0.25", "--remove-after", "12", "--out", str(out)]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return json.loads((out / "result.json").read_text()), r.stdout, out


def test_one_sampler_per_gpu_on_its_own_node(multinode):
    result, _, _ = multinode
    assert result["samplers"] == 6
    assert sorted(result["samplers_per_node"].values()) == [2, 2, 2]
    assert result["samplers_on_their_node"] is True


def test_a_probe_on_each_node_finds_exactly_its_own_nodes_samplers(multinode):
    result, _, _ = multinode
    lookups = result["lookups"]
    assert len(lookups) == 3
    by_node: dict[str, set] = {}
    for uuid, g in result["per_gpu"].items():
        by_node.setdefault(g["node"], set()).add(uuid)
    for node, found in lookups.items():
        assert set(found) == by_node[node], node


def test_file_sd_lists_every_gpu_on_loopback_and_each_target_answers(multinode):
    result, _, _ = multinode
    assert result["targets_seen"] == 6 and result["target_hosts"] == ["127.0.0.1"]
    assert len(result["scrapes"]) == 6 and all(s["bytes"] > 1000 for s in result["scrapes"])


def test_a_node_removed_mid_run_costs_only_its_own_gpus(multinode):
    result, _, out = multinode
    removed = result["removed_node"]
    assert removed and removed != result["head"]
    steps = {u: g["steps"] for u, g in result["per_gpu"].items()}
    lost = [u for u, g in result["per_gpu"].items() if g["on_removed_node"]]
    kept = [u for u in steps if u not in lost]
    assert len(lost) == 2 and len(kept) == 4
    # the job went on: every step of the capture on every GPU of the other nodes
    assert all(steps[u] == 40 for u in kept), steps
    # the lost GPUs keep what was drained before the node went, and stop there
    assert all(steps[u] < 40 for u in lost), steps
    assert result["gpus_lost"] == 2
    # the run store counts the samplers it lost, each once, however many calls to them failed
    assert result["samplers_unreachable"] == 2
    assert result["sampler_calls_failed"] >= 2
    report = (out / "report.txt").read_text()
    for g in (result["per_gpu"][u] for u in lost):
        assert f"on node {g['node'][:12]} was LOST" in report
    assert report.count("was LOST") == 2
    assert "Compared: the 4 GPUs that were not lost." in report
    # every GPU replays the same capture: the fleet says they peak alike
    assert "Every compared GPU's highest within-step peak is the same: 5.72 GiB (4 GPUs)" in report

"""A real multi-node Ray cluster on one machine, with replayed GPUs: the distributed half of
stepmem without GPUs.

``ray.cluster_utils.Cluster`` starts a head and worker raylets, every one on 127.0.0.1, each a
Ray node of its own. The main job (``run_job``, replay backend) runs against it. While it runs
this script checks, from every node, that a probe there finds exactly its own node's samplers;
reads the job's ``file_sd`` file; scrapes every target once (bytes, milliseconds); and, with
``--remove-after K``, removes the last worker node after step K has been played. With
``--prometheus`` a real Prometheus (loopback) scrapes every sampler through the job's ``file_sd``
file and receives its per-step series by remote write; its own ``/metrics`` read before and
after the job give what the run cost it (CPU seconds, samples appended). It writes
``result.json`` (and the run store, the records and the report) under ``--out``.

    python benchmarks/multinode.py --nodes 3 --gpus 2 --remove-after 10 \\
        --out benchmarks/results/local-multinode
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from collector.analysis.report import render_report  # noqa: E402
from collector.analysis.runs import load_run  # noqa: E402
from collector.lookup import SamplerLookup, list_samplers  # noqa: E402
from collector.model.settings import JobOptions, SamplerOptions  # noqa: E402
from collector.run.job import run_job  # noqa: E402
from collector.run.ray_session import loopback_only_ray  # noqa: E402


@ray.remote(num_cpus=0)
def probe_lookup(uuids: list[str]) -> tuple[str, list[str]]:
    """What a probe on this node finds: the UUIDs (of all the cluster's GPUs) whose sampler it
    reaches by its own node id, as a training process there does."""
    node = ray.get_runtime_context().get_node_id()
    lookup = SamplerLookup()
    return node, [u for u in uuids if lookup.find(u) is not None]


def start_cluster(nodes: int, cpus: int):
    from ray.cluster_utils import Cluster

    loopback_only_ray()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway cluster on loopback
    args = {"num_cpus": cpus, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False})
    workers = [cluster.add_node(**args) for _ in range(nodes - 1)]
    ray.init(
        address=cluster.address,
        _node_ip_address="127.0.0.1",
        namespace="stepmem",
        log_to_driver=False,
        configure_logging=False,
    )
    cluster.wait_for_nodes()
    return cluster, workers


def prom_counters(url: str) -> dict[str, float]:
    """Prometheus' own CPU seconds and samples appended so far (its /metrics)."""
    want = ("process_cpu_seconds_total", "prometheus_tsdb_head_samples_appended_total")
    out: dict[str, float] = dict.fromkeys(want, 0.0)
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in want:
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def prom_query(url: str, q: str) -> list:
    from urllib.parse import quote

    with urllib.request.urlopen(f"{url}/api/v1/query?query={quote(q)}", timeout=10) as r:
        return json.load(r)["data"]["result"]


def scrape(target: str) -> tuple[int, float]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as r:
        n = len(r.read())
    return n, (time.perf_counter() - t0) * 1000


class Watcher:
    """Everything checked while the job runs, from another thread."""

    def __init__(self, cluster, workers, targets: Path, remove_after: int) -> None:
        self.cluster, self.workers, self.targets = cluster, workers, targets
        self.remove_after = remove_after
        self.result: dict = {"targets_seen": 0, "lookups": {}, "scrapes": []}
        self.removed_node: str | None = None
        self._checked = threading.Event()

    def echo(self, line: str) -> None:
        print(line, flush=True)
        words = line.split()
        if words[:2] == ["replayed", "step"]:
            step = int(words[2])
            if step == 2 and not self._checked.is_set():
                self._checked.set()
                self.check()
            if self.remove_after and step == self.remove_after and self.removed_node is None:
                victim = self.workers[-1]
                self.removed_node = victim.node_id
                self.result["removed_at_step"] = step
                threading.Thread(target=self.cluster.remove_node, args=(victim,)).start()
                print(f"removed node {victim.node_id[:12]} after step {step}", flush=True)

    def check(self) -> None:
        groups = json.loads(self.targets.read_text() or "[]")
        targets = [t for g in groups for t in g["targets"]]
        self.result["targets_seen"] = len(targets)
        self.result["target_hosts"] = sorted({t.split(":")[0] for t in targets})
        for t in targets:
            size, ms = scrape(t)
            self.result["scrapes"].append({"target": t, "bytes": size, "ms": round(ms, 2)})
        uuids = [g["labels"]["gpu_uuid"] for g in groups]
        alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        refs = [
            probe_lookup.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote(uuids)
            for node in alive
        ]
        for node, found in ray.get(refs, timeout=60):
            self.result["lookups"][node] = found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3, help="Ray nodes, head included")
    ap.add_argument("--gpus", type=int, default=2, help="replayed GPUs per node")
    ap.add_argument("--cpus", type=int, default=1, help="CPUs each node offers Ray")
    ap.add_argument("--capture", default="spiky")
    ap.add_argument("--speed", type=float, default=0.25)
    ap.add_argument("--remove-after", type=int, default=0, help="remove a worker after step K")
    ap.add_argument(
        "--prometheus", action="store_true", help="scrape and remote-write into a real Prometheus"
    )
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.nodes < 2 or (a.remove_after and a.nodes < 2):
        ap.error("--nodes must be at least 2 (a head and a worker)")
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    cluster, workers = start_cluster(a.nodes, a.cpus)
    print(f"cluster of {a.nodes} nodes up in {time.monotonic() - t0:.1f} s", flush=True)
    head = ray.get_runtime_context().get_node_id()
    prom = remote_write = None
    targets = a.out / "targets.json"
    if a.prometheus:
        from collector.export.remote_write import RemoteWriteConfig
        from tests.prom import Prometheus

        prom = Prometheus(a.out / "prometheus", scrape_s=1.0).start()
        targets = prom.targets / "stepmem.json"  # the file its file_sd reads
        remote_write = RemoteWriteConfig(url=f"{prom.url}/api/v1/write")
    watcher = Watcher(cluster, workers, targets, a.remove_after)
    opts = JobOptions(
        backend="replay",
        captures=[a.capture],
        gpus=a.gpus,
        speed=a.speed,
        ray_address=cluster.address,
        targets=targets,
        store=a.out / "runs",
        sampler=SamplerOptions(
            metrics_addr="127.0.0.1", run_id="multinode", remote_write=remote_write
        ),
    )
    before = prom_counters(prom.url) if prom else {}
    t1 = time.monotonic()
    prom_result: dict = {}
    try:
        result = run_job(opts, echo=watcher.echo)
        records = result.records
        (a.out / "records.json").write_text(json.dumps(result.document(), indent=1))
        job_s = time.monotonic() - t1
        samplers_left = list_samplers()
        if prom:
            time.sleep(2)  # the last scrape and push land
            after = prom_counters(prom.url)
            q = 'sum by (gpu_uuid) (count_over_time(stepmem_step{job="stepmem-steps"}[10m]))'
            pushed = {r["metric"]["gpu_uuid"]: int(r["value"][1]) for r in prom_query(prom.url, q)}
            scraped = prom_query(prom.url, 'count(count_over_time(up{job="stepmem"}[10m]))')
            prom_result = {
                "prometheus_cpu_s": round(
                    after["process_cpu_seconds_total"] - before["process_cpu_seconds_total"], 3
                ),
                "prometheus_samples_appended": int(
                    after["prometheus_tsdb_head_samples_appended_total"]
                    - before["prometheus_tsdb_head_samples_appended_total"]
                ),
                "steps_pushed_per_gpu": pushed,
                "targets_scraped": int(scraped[0]["value"][1]) if scraped else 0,
            }
    finally:
        ray.shutdown()
        cluster.shutdown()
        if prom:
            prom.stop()
    run = load_run(a.out / "runs" / "multinode")
    text, _ = render_report(run)
    (a.out / "report.txt").write_text(text)
    meta = run.meta
    per_gpu: dict[str, dict] = {}
    for s in run.samplers:
        steps = sorted(r.step for r in records if r.gpu_uuid == s.gpu_uuid)
        per_gpu[s.gpu_uuid] = {
            "node": s.node_id,
            "index": s.index,
            "steps": len(steps),
            "last_step": steps[-1] if steps else None,
            "on_removed_node": s.node_id == watcher.removed_node,
        }
    nodes = sorted({s.node_id for s in run.samplers})
    result = {
        "command": " ".join(["python", "benchmarks/multinode.py", *sys.argv[1:]]),
        "nodes": a.nodes,
        "gpus_per_node": a.gpus,
        "head": head,
        "removed_node": watcher.removed_node,
        "job_seconds": round(job_s, 1),
        "samplers": len(run.samplers),
        "samplers_per_node": {n: sum(s.node_id == n for s in run.samplers) for n in nodes},
        # the node each sampler was placed for is the node its actor process runs on
        "samplers_on_their_node": all(s.actor_node_id == s.node_id for s in run.samplers),
        "status": meta.get("status"),
        "samplers_unreachable": meta.get("samplers_unreachable"),  # samplers, each once
        "sampler_calls_failed": meta.get("sampler_calls_failed"),
        "gpus_lost": sum(bool(h.get("unreachable")) for h in meta.get("health") or []),
        "per_gpu": per_gpu,
        **watcher.result,
        **prom_result,
        "remote_write_per_sampler": [h.get("remote_write") for h in meta.get("health") or []],
        "samplers_left_after_job": len(samplers_left),
    }
    (a.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(text)
    print(json.dumps({k: v for k, v in result.items() if k != "per_gpu"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

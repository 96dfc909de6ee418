"""Launching one sampler actor per GPU on every node.

Placement rules:

* one actor per physical GPU, ``num_cpus=0, num_gpus=0`` — a fractional GPU request would pack
  every sampler onto GPU 0's share and could block training workers from being scheduled;
* pinned with ``NodeAffinitySchedulingStrategy(node_id, soft=False)``;
* named ``stepmem:<owner>:<node_id>:<gpu_uuid>`` in namespace ``stepmem``, the owner being the
  launching Ray job (or ``daemon``), so any process of that job finds the sampler of (its node,
  its GPU) by name (:mod:`collector.lookup`), and two runs on one cluster each have their own;
* owned by the launching driver (dies with the job) unless ``detached=True`` (the daemon's).

The backend is chosen per actor (:class:`collector.backends.BackendSpec`): ``nvml`` reads the
node's GPUs; ``replay`` plays committed captures as simulated GPUs (for machines and CI without
GPUs).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from collector.actor import SamplerActor
from collector.backends import BackendSpec
from collector.lookup import DAEMON, NAMESPACE, sampler_name, this_job
from collector.model.errors import StepmemError
from collector.model.records import SamplerInfo
from collector.model.settings import SamplerOptions
from collector.nvml import LiveBackend, NvmlUnavailable

__all__ = ["PlacedSampler", "launch_samplers", "new_run_id"]


def new_run_id() -> str:
    """A run id for labels: UTC time and 4 random hex digits (bounded: one per run)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + os.urandom(2).hex()


@ray.remote(num_cpus=0, num_gpus=0)
def _node_gpus() -> list[dict[str, Any]]:
    try:
        return [d.__dict__ for d in LiveBackend().devices()]
    except NvmlUnavailable:
        return []


NODES_TIMEOUT_S = 60.0  # ray.nodes() has no timeout: it waits for ever on a GCS that never answers
READY_TIMEOUT_S = 120.0  # a sampler actor's first answer (its process started, its backend open)


def _alive_nodes() -> list[str]:
    """The alive nodes' ids, asked of the GCS within :data:`NODES_TIMEOUT_S` (a thread of its
    own: the call cannot be interrupted); a GCS that does not answer is one line, not a hang."""
    answer: dict[str, Any] = {}

    def ask() -> None:
        try:
            answer["nodes"] = ray.nodes()
        except Exception as exc:  # handed to the caller below
            answer["error"] = exc

    asking = threading.Thread(target=ask, name="stepmem-ray-nodes", daemon=True)
    asking.start()
    asking.join(NODES_TIMEOUT_S)
    if "nodes" not in answer:
        why = (
            f"it failed: {answer['error']}"
            if "error" in answer
            else (f"it did not answer within {NODES_TIMEOUT_S:g} s")
        )
        raise StepmemError(f"cannot list the Ray cluster's nodes ({why}); is its head alive?")
    return [n["NodeID"] for n in answer["nodes"] if n.get("Alive")]


def _first_answers(launched: list[tuple[str, str, str, Any]], run_id: str) -> list[SamplerInfo]:
    """Each launched sampler's :class:`SamplerInfo`; samplers that did not answer within
    :data:`READY_TIMEOUT_S` are killed and named (a node whose raylet is gone, a machine so
    loaded no worker starts)."""
    refs = [handle.info.remote() for *_, handle in launched]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=READY_TIMEOUT_S)
    if len(ready) == len(refs):
        return ray.get(refs)
    done = set(ready)
    silent = [one for one, ref in zip(launched, refs, strict=True) if ref not in done]
    for one, ref in zip(launched, refs, strict=True):  # a half-started launch leaves nothing
        if ref not in done or _ours(ref, run_id):  # (another launch's sampler stays)
            ray.kill(one[3], no_restart=True)
    node_id, uuid = silent[0][0], silent[0][1]
    more = f" ({len(silent)} of {len(refs)} samplers)" if len(silent) > 1 else ""
    raise StepmemError(
        f"the sampler of GPU {uuid} on node {node_id[:12]} did not start within "
        f"{READY_TIMEOUT_S:g} s{more}: its node's raylet may be gone or the machine too loaded "
        "to start a worker; Ray's logs say which"
    )


def _ours(ref: Any, run_id: str) -> bool:
    """Whether the sampler that answered ``ref`` was started for ``run_id`` (one that died
    answering is nobody's: it goes too)."""
    try:
        return ray.get(ref).run_id == run_id
    except ray.exceptions.RayError:
        return True


def _gpus_on(node_id: str, spec: BackendSpec) -> list[dict[str, Any]]:
    if spec.kind == "replay":
        return [d.__dict__ for d in spec.build(node_id).devices()]
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return ray.get(_node_gpus.options(scheduling_strategy=strategy).remote(), timeout=60)


@dataclass
class PlacedSampler:
    """A sampler actor this launch placed (or found): where, its name and handle, and what
    it said about itself when it started."""

    node_id: str
    gpu_uuid: str
    name: str
    handle: Any
    info: SamplerInfo


def launch_samplers(
    spec: BackendSpec,
    options: SamplerOptions | None = None,
    detached: bool = False,
    nodes: list[str] | None = None,
) -> list[PlacedSampler]:
    """Place one sampler actor per GPU on every alive node (or on ``nodes``).

    Idempotent within an owner: an actor that already exists under the same name (this job's,
    or with ``detached`` the daemon's) is reused, not doubled; another job's never is. Raises
    :class:`StepmemError` when no node has a GPU for the chosen backend. ``options`` and
    ``spec`` are left as given: a run id (``options.run_id`` empty) and a replay's origin
    (``spec.origin_ns`` None) are chosen for this launch's actors only.
    """
    options = options or SamplerOptions()
    if not options.run_id:
        options = dataclasses.replace(options, run_id=new_run_id())
    if spec.kind == "replay" and spec.origin_ns is None:
        spec = dataclasses.replace(spec, origin_ns=time.monotonic_ns())
    found = [
        (node_id, gpu) for node_id in nodes or _alive_nodes() for gpu in _gpus_on(node_id, spec)
    ]
    if options.metrics_port and found:
        top = options.metrics_port + max(gpu["index"] for _, gpu in found)
        if top > 65535:
            raise StepmemError(
                f"--metrics-port {options.metrics_port}: GPU index "
                f"{top - options.metrics_port} would serve on port {top}; the largest is 65535"
            )
    launched = []
    owner = DAEMON if detached else this_job()
    for node_id, gpu in found:
        name = sampler_name(owner, node_id, gpu["uuid"])
        handle = SamplerActor.options(
            name=name,
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached" if detached else None,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(node_id, gpu["uuid"], spec, options)
        launched.append((node_id, gpu["uuid"], name, handle))
    if not launched:
        raise StepmemError(
            "no GPU found on any alive Ray node for the nvml backend; on a machine without GPUs "
            "use the replay backend (--backend replay)"
        )
    infos = _first_answers(launched, options.run_id)
    placed = [PlacedSampler(*one, info) for one, info in zip(launched, infos, strict=True)]
    failed = [p for p in placed if p.info.error]
    if failed:
        for p in placed:  # none of this launch's samplers stays behind
            if p.info.run_id == options.run_id:
                ray.kill(p.handle, no_restart=True)
        first = failed[0]
        raise StepmemError(
            f"the sampler of GPU {first.info.index} on node {first.node_id[:12]} "
            f"{first.info.error}" + (f" ({len(failed)} samplers failed)" if len(failed) > 1 else "")
        )
    return placed

"""Finding a GPU's sampler actor by name, from any process of the cluster (a training process, a
Ray Train worker, the job driver). Imports Ray and nothing of the sampler side: the training
process loads this module only.

A sampler is named ``stepmem:<owner>:<node_id>:<gpu_uuid>`` in namespace ``stepmem``. Its owner
is the Ray job that placed it (the job id: a run's samplers belong to that run alone, so two
runs on one cluster never share a sampler or stop each other's) or ``daemon`` (detached
samplers of ``stepmem daemon``, shared by every job). A process finds its own job's samplers
first (a Ray Train worker is in its driver's job), then the daemon's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["DAEMON", "NAMESPACE", "SamplerLookup", "list_samplers", "owner_of", "sampler_name"]

NAMESPACE = "stepmem"
DAEMON = "daemon"


def sampler_name(owner: str, node_id: str, gpu_uuid: str) -> str:
    return f"stepmem:{owner}:{node_id}:{gpu_uuid}"


def owner_of(name: str) -> str:
    """The owner part of a sampler's name (``daemon`` or a job id); "" for another name."""
    parts = name.split(":")
    return parts[1] if len(parts) == 4 and parts[0] == "stepmem" else ""


def this_job() -> str:
    """The Ray job id of this process (a run's samplers are named by it)."""
    import ray

    return ray.get_runtime_context().get_job_id()


class SamplerLookup:
    """The sampler actor for (a node, a GPU UUID), with a cache of its own: this process's
    job's, else the daemon's.

    A found handle is reused for ``handle_ttl_s`` seconds, then looked up again (a sampler killed
    and launched anew under the same name is a new actor; a restarted one keeps its handle). A
    miss is remembered for ``miss_retry_s`` seconds so a probe without a sampler does not ask the
    GCS every step. Called from the probe's sender thread, never the hot path. Each probe (each
    outbox) owns one; nothing is shared between them, so nothing needs resetting.
    """

    def __init__(
        self,
        handle_ttl_s: float = 10.0,
        miss_retry_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        owners: list[str] | None = None,
    ) -> None:
        self.handle_ttl_s, self.miss_retry_s, self._clock = handle_ttl_s, miss_retry_s, clock
        self._owners = owners
        self._found: dict[tuple[str, str], tuple[Any, float]] = {}
        self._missed: dict[tuple[str, str], float] = {}

    def owners(self) -> list[str]:
        """Whose samplers are looked for, in order: this job's, then the daemon's."""
        if self._owners is None:
            self._owners = [this_job(), DAEMON]
        return self._owners

    def find(self, gpu_uuid: str, node_id: str | None = None) -> Any | None:
        """The sampler of ``gpu_uuid`` on ``node_id`` (default: this process's node), or None."""
        import ray

        if node_id is None:
            node_id = ray.get_runtime_context().get_node_id()
        key = (node_id, gpu_uuid)
        now = self._clock()
        found = self._found.get(key)
        if found is not None and now - found[1] < self.handle_ttl_s:
            return found[0]
        missed = self._missed.get(key)
        if missed is not None and now - missed < self.miss_retry_s:
            return None
        for owner in self.owners():
            try:
                handle = ray.get_actor(sampler_name(owner, node_id, gpu_uuid), namespace=NAMESPACE)
            except ValueError:
                continue
            self._found[key] = (handle, now)
            self._missed.pop(key, None)
            return handle
        self._found.pop(key, None)
        self._missed[key] = now
        return None

    __call__ = find


def list_samplers(owner: str | None = None) -> list[str]:
    """Names of every stepmem sampler actor alive in the cluster (no dashboard needed), or of
    one owner's (``daemon``, a job id)."""
    import ray

    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(
        a["name"]
        for a in named
        if a["namespace"] == NAMESPACE
        and owner_of(a["name"])
        and (owner is None or owner_of(a["name"]) == owner)
    )

"""Finding a GPU's sampler actor by name, from any process of the cluster (a training process, a
Ray Train worker, the job driver). Imports Ray and nothing of the sampler side: the training
process loads this module only.

A sampler is named ``stepmem:<node_id>:<gpu_uuid>`` in namespace ``stepmem``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["NAMESPACE", "SamplerLookup", "list_samplers", "sampler_name"]

NAMESPACE = "stepmem"


def sampler_name(node_id: str, gpu_uuid: str) -> str:
    return f"stepmem:{node_id}:{gpu_uuid}"


class SamplerLookup:
    """The sampler actor for (a node, a GPU UUID), with a cache of its own.

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
    ) -> None:
        self.handle_ttl_s, self.miss_retry_s, self._clock = handle_ttl_s, miss_retry_s, clock
        self._found: dict[tuple[str, str], tuple[Any, float]] = {}
        self._missed: dict[tuple[str, str], float] = {}

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
        try:
            handle = ray.get_actor(sampler_name(node_id, gpu_uuid), namespace=NAMESPACE)
        except ValueError:
            self._found.pop(key, None)
            self._missed[key] = now
            return None
        self._found[key] = (handle, now)
        self._missed.pop(key, None)
        return handle

    __call__ = find


def list_samplers() -> list[str]:
    """Names of every stepmem sampler actor alive in the cluster (no dashboard needed)."""
    import ray

    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(
        a["name"] for a in named if a["namespace"] == NAMESPACE and a["name"].startswith("stepmem:")
    )

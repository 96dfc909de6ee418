"""Real training workloads for stepmem: ``finetune`` (the seed scenario), ``spiky`` (known
transients) and ``patterns`` (a leak, an allocator jump, an OOM)."""

from __future__ import annotations

import json
from typing import Any


def finish(summary: dict[str, Any], probe: Any, summary_path: Any) -> int:
    """The end of a workload run as a script: close its probe, print the summary as JSON (and
    write it to ``summary_path`` if given)."""
    if probe is not None:
        probe.close()
        summary["probe_cost_ns"] = probe.cost_ns
    text = json.dumps(summary, indent=1)
    if summary_path:
        summary_path.write_text(text)
    print(text)
    return 0

"""Shared fixtures: a real local Ray cluster on loopback, captures, and CPU-only helpers."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# loopback only: the Hugging Face Hub (and the hub kernels bitsandbytes' CPU ops look for) off
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("USE_HUB_KERNELS", "NO")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Single-machine Ray on loopback: without this, Ray swaps 127.0.0.1 for the machine's outward
# address (its "remotely reachable" IP) and its agents listen and are reached there.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, interval: float = 0.05) -> None:
    """Poll ``condition`` until true (bounded in time); fail with a clear message otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    pytest.fail(f"condition not met within {timeout} s")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One real local Ray cluster for the session, bound to 127.0.0.1, no dashboard."""
    import ray

    ray.init(
        # "local": always a cluster of its own, never the `ray start` head that
        # /tmp/ray/ray_current_cluster or RAY_ADDRESS names (another test's, or a user's)
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=2,
        configure_logging=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def kill_samplers(ray_cluster: None) -> Iterator[list]:
    """Actors appended to the yielded list are killed after the test (tests stay independent)."""
    import ray

    handles: list = []
    yield handles
    for h in handles:
        ray.kill(h, no_restart=True)


def loopback(**kw):
    """SamplerOptions for tests: /metrics bound to 127.0.0.1 (Ray's node address here may be the
    machine's outward one; tests only ever talk to loopback)."""
    from collector.model.settings import SamplerOptions

    return SamplerOptions(metrics_addr="127.0.0.1", **kw)


@pytest.fixture
def run_dir(tmp_path):
    """A closed run store of the seed's 7B run (its records and samplers, no samples)."""
    from collector.store import RunWriter
    from tests.records import seed_doc, typed

    doc = seed_doc()
    w = RunWriter(tmp_path / "run", {"run_id": "run", "samplers": doc["samplers"]})
    w.add_records(typed(doc["records"]))
    w.close("complete")
    return tmp_path / "run"


# -- the fault table -----------------------------------------------------------------------------
# Fault and bad-input tests end by recording what they measured (after their assertions, so a row
# means the test passed). `python benchmarks/faults.py` runs them with STEPMEM_FAULT_TABLE set and
# renders the committed table from the rows.
_FAULTS: list[dict] = []


@pytest.fixture
def record_fault(request):
    def record(fault: str, outcome: str, **figures) -> None:
        _FAULTS.append({"fault": fault, "outcome": outcome, "test": request.node.nodeid, **figures})

    return record


def pytest_collection_modifyitems(config, items):
    """A test that records a fault-table row is marked ``fault``: ``benchmarks/faults.py`` runs
    those (``-m fault``), wherever their component's file keeps them."""
    for item in items:
        if "record_fault" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.fault)


def pytest_sessionfinish(session, exitstatus):
    import json

    path = os.environ.get("STEPMEM_FAULT_TABLE")
    if path and _FAULTS:
        with open(path, "w") as f:
            json.dump(_FAULTS, f, indent=1)

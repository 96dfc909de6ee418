"""The Ray side of a run's lifetime: connecting to a cluster or starting one of our own on
loopback, signals while a run is on, and stopping what was started however the run ends.

:class:`RaySession` is the one place that owns it: ``with RaySession(address, echo):`` connects
(or starts a local cluster), turns SIGTERM into the Ctrl-C path and, on the way out, stops a local
cluster (and reaps what Ray leaves behind) and gives the caller its signal handlers back.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from typing import Any

import ray

from collector.model.errors import StepmemError, first_line
from collector.signals import terminate_as_interrupt

__all__ = [
    "RaySession",
    "connect_ray",
    "is_loopback_address",
    "loopback_only_ray",
    "start_local_ray",
    "stop_local_ray",
    "terminate_as_interrupt",
]


def loopback_only_ray() -> None:
    """Keep a single-machine Ray cluster that this process starts on 127.0.0.1. Ray replaces
    127.0.0.1 by the machine's outward address (its "remotely reachable" IP) unless multi-node
    clusters are switched off, which it reads from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` at
    import (for this process) and in every process it starts (from the environment)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False  # read when the node address is resolved
    except (ImportError, AttributeError):  # another Ray: the environment variable still holds
        pass


def is_loopback_address(address: str | None) -> bool:
    """Whether a Ray address (``127.0.0.1:6379``, ``ray://localhost:10001``,
    ``http://[::1]:8265``) names this machine's loopback interface."""
    import ipaddress
    from urllib.parse import urlsplit

    if not address or address in ("auto", "local"):
        return False
    host = urlsplit(address if "://" in address else f"//{address}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _ray_error(exc: BaseException, address: str | None) -> StepmemError:
    """A Ray start or connection failure as the one line a user can act on."""
    first = first_line(exc, 300)
    where = f"the Ray cluster at {address}" if address else "Ray"
    chain, e = [], exc
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    auth = any(
        isinstance(e, ray.exceptions.AuthenticationError) or "authtoken" in str(e).lower()
        for e in chain
    )
    if auth:
        return StepmemError(
            f"{where} wants an auth token: set RAY_AUTH_MODE=token (Ray then finds the token in "
            "~/.ray/auth_token, or set RAY_AUTH_TOKEN; `ray get-auth-token` on the head prints "
            "it)"
        )
    if "Invalid address" in first:
        return StepmemError(f"{where}: not a Ray address ({first}); give host:port")
    if "timed out during startup" in first:
        return StepmemError(
            "Ray could not start on this machine (its node timed out during startup: a full "
            "disk or /tmp, or an overloaded machine); see Ray's logs in "
            f"{ray_logs()}"
        )
    return StepmemError(f"cannot connect to {where}: {first}")


def ray_logs() -> str:
    """Where this machine's Ray keeps the newest session's logs: under ``RAY_TMPDIR`` when set
    (Ray's own rule), else the system's temp folder — not another cluster's by default."""
    import tempfile

    base = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
    return os.path.join(base, "ray", "session_latest", "logs")


def _init(address: str | None, **kwargs: Any) -> None:
    try:
        ray.init(address=address, **kwargs)
    except (ConnectionError, ValueError, ray.exceptions.RayError, TimeoutError) as exc:
        raise _ray_error(exc, None if address == "local" else address) from None
    except Exception as exc:  # Ray raises plain Exception for a node that never came up
        if "timed out during startup" in str(exc):
            raise _ray_error(exc, None) from None
        text = str(exc)
        if "Failed to start" in text or "failed to start" in text:  # its GCS, raylet, …
            log = next((w for w in text.split() if w.endswith((".out", ".err", ".log"))), "")
            raise StepmemError(
                "Ray could not start its head on this machine ("
                + re.sub(r"\s*Last 0 lines of error files:.*", "", first_line(exc, 160))
                + ")"
                + (f"; its log: {log}" if log else "")
                + " — a file-size limit (ulimit -f), a full disk or /tmp, or no room for its "
                "processes"
            ) from None
        raise


def connect_ray(address: str | None) -> None:
    """Connect to an existing cluster at ``address`` (else ``RAY_ADDRESS``), keeping a loopback
    address as given: Ray would otherwise swap 127.0.0.1 for the machine's outward address and
    wait for a node there that never answers. A cluster that cannot be reached, an address that
    is not one, a token the cluster wants: one line (:class:`StepmemError`)."""
    where = address or os.environ.get("RAY_ADDRESS")
    if is_loopback_address(where):
        loopback_only_ray()
    _listening(where)
    _no_token_wanted(where)
    _init(where, namespace="stepmem")


REACH_S = 5.0  # how long a cluster's address gets to accept a connection before Ray is asked


def _listening(address: str | None) -> None:
    """A ``host:port`` where nothing listens (connection refused, no route, no answer within
    :data:`REACH_S`) is said in one line at once: Ray's client would retry it for minutes.
    Other forms (``auto``, ``ray://…``, a name Ray resolves itself) are left to Ray."""
    import socket

    target = _host_port(address)
    if target is None:
        return  # Ray resolves it, or says what is wrong with it
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + REACH_S
    why = ""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except socket.gaierror as exc:
            raise StepmemError(
                f"cannot connect to the Ray cluster at {address}: {host!r} is not a known host "
                f"({exc.strerror or exc})"
            ) from None
        except OSError as exc:  # refused: a head starting up may open it in a moment
            why = exc.strerror or type(exc).__name__
            time.sleep(0.25)
    raise StepmemError(
        f"cannot connect to the Ray cluster at {address}: nothing answers there ({why}, for "
        f"{REACH_S:.0f} s); is its head running (`ray status --address {address}`)?"
    )


def _no_token_wanted(address: str | None) -> None:
    """A cluster with token authentication, reached without a token (``RAY_AUTH_MODE`` not
    ``token``): one line at once. Ray's client would print about twenty ``InvalidAuthToken``
    lines over some 20 s before it gave up. One gRPC call to the GCS, bounded at 3 s; any other
    answer (or none) is left to Ray."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return
    target = _host_port(address)
    if target is None:
        return
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:  # another Ray: its own message will do
        return
    with grpc.insecure_channel(target) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=3.0)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise _ray_error(ConnectionError("InvalidAuthToken"), address) from None


def _host_port(address: str | None) -> str | None:
    """``host:port`` of a plain GCS address; None for the forms Ray resolves itself."""
    if not address or "://" in address or address in ("auto", "local"):
        return None
    host, sep, port = address.rpartition(":")
    return address if sep and port.isdigit() and host else None


def _init_ray(address: str | None) -> bool:
    """Connect to the cluster (``address``, else ``RAY_ADDRESS``), or start a local one on
    loopback. Returns True when this process started a local cluster."""
    if ray.is_initialized():
        return False
    if address or os.environ.get("RAY_ADDRESS"):
        connect_ray(address)
        return False
    start_local_ray()
    return True


TASK_EVENTS_ENV = "RAY_task_events_max_num_task_in_gcs"
LOCAL_TASK_EVENTS = 10_000  # the local cluster's GCS keeps at most this many tasks' events


def start_local_ray(**options: Any) -> None:
    """Start a single-machine Ray cluster of this process's own, on 127.0.0.1 only (the job
    without a cluster, the benchmarks). ``options`` go to ``ray.init``. Its processes go with
    this one however it ends (:func:`collector.reaper.guard`)."""
    import collector.reaper as reaper

    loopback_only_ray()
    # Ray's GCS keeps every task's events for its dashboard, up to 100,000 (a replay's step
    # events are actor calls: GCS grew 44 -> 77 MB over 40,000); nobody reads this cluster's
    os.environ.setdefault(TASK_EVENTS_ENV, str(LOCAL_TASK_EVENTS))
    reaper.guard()
    _init(
        # "local": a new cluster of our own, never one that /tmp/ray/ray_current_cluster names
        # (a `ray start` head that may be long gone)
        "local",
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        namespace="stepmem",
        **{"configure_logging": False, **options},
    )


def stop_local_ray() -> None:
    """Shut down the local cluster :func:`start_local_ray` started, then remove any of its
    processes still there (Ray's agents outlive ``ray.shutdown()`` by up to a minute)."""
    import collector.reaper as reaper

    ray.shutdown()
    token = os.environ.get(reaper.MARK)  # set by reaper.guard() before the cluster started
    if token:
        reaper.reap(token)


class RaySession:
    """Ray for the length of one run. Entering connects to ``address`` (else ``RAY_ADDRESS``) or
    starts a local cluster on loopback (``local`` is then True) and makes SIGTERM end the run like
    Ctrl-C (installed after ``ray.init``, which sets a SIGTERM handler of its own). Leaving stops a
    local cluster now, not in Ray's atexit hook that a signal can cut, and restores the caller's
    SIGINT/SIGTERM handlers."""

    def __init__(self, address: str | None, echo=print) -> None:
        self.address, self.echo = address, echo
        self.local = False
        self._handlers: dict[int, Any] = {}

    def __enter__(self) -> RaySession:
        self._handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        self.local = _init_ray(self.address)
        terminate_as_interrupt(self.echo)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.local:
                stop_local_ray()
        finally:
            for sig, h in self._handlers.items():
                # not the main thread, or a handler that is not Python's: leave it
                with contextlib.suppress(ValueError, TypeError):
                    signal.signal(sig, h)

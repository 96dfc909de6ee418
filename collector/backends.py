"""What the sampler side needs from a GPU backend, and how one travels to a sampler actor.

Two backends implement :class:`Backend`: live NVML (:class:`collector.nvml.LiveBackend`) and the
replay of captures recorded on a real GPU (:class:`collector.replay.ReplayBackend`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from collector.model.records import DeviceInfo, ProcessMemory

__all__ = ["Backend", "BackendSpec", "Device", "ReplayControl"]


class Device(Protocol):
    """One opened GPU: what the sampler and its actor use."""

    info: DeviceInfo
    backend: str  # "nvml" | "replay"
    memory_info_version: int

    @property
    def uuid(self) -> str: ...

    def read(self) -> tuple[int, int]:
        """(used, reserved) bytes now; raises :class:`collector.nvml.NvmlError`."""
        ...

    def processes(self) -> list[ProcessMemory]: ...

    def processes_reading(self, t_ns: int) -> tuple[int, int, list[ProcessMemory]]:
        """(when read, device used then, per-process memory) for the moment ``t_ns``, or as near
        to it as the backend can: live NVML reads now, a replay its snapshot nearest."""
        ...


@runtime_checkable
class ReplayControl(Protocol):
    """What only a replayed GPU (:class:`collector.replay.ReplayDevice`) does: play from a
    chosen moment, once or in a loop; hold (read nothing) until told where to play; fail its
    reads on purpose; and read the value in force at a given moment, so a sample's timestamp
    is exactly the moment it shows."""

    origin_ns: int  # monotonic time at which capture time 0 plays
    loop: bool  # play the capture again after its end (else hold its last value)

    def align(self, origin_ns: int, loop: bool) -> None: ...

    def hold(self) -> None: ...

    def inject(self, kind: str, every: int = 1, from_ns: int = 0) -> None: ...

    def read_at(self, t_ns: int) -> tuple[int, int]: ...

    def sample_at(self, t_ns: int) -> tuple[int, int, int, int]: ...


class Backend(Protocol):
    """The GPUs of one node."""

    def devices(self) -> list[DeviceInfo]: ...

    def open(self, uuid: str) -> Device: ...


@dataclass
class BackendSpec:
    """Which backend a sampler actor builds, in a form that travels to other processes.

    ``kind`` is ``"nvml"`` or ``"replay"``. For replay: ``captures`` (names or paths), ``gpus``
    per node (default: one per capture), ``speed`` and ``origin_ns`` (monotonic time at which
    every replayed GPU of a node starts playing; default: when the launcher ran); with
    ``hold_until_aligned`` a replayed GPU reads nothing until ``replay_from`` says where to play
    (a run's: it aligns them once all run, and again one that Ray restarted).
    """

    kind: str = "nvml"
    captures: list[str] = field(default_factory=list)
    gpus: int | None = None
    speed: float = 1.0
    origin_ns: int | None = None
    hold_until_aligned: bool = False  # replay: read nothing until replay_from (a run aligns it)

    def __post_init__(self) -> None:
        if self.kind not in ("nvml", "replay"):
            raise ValueError(f"backend must be 'nvml' or 'replay', got {self.kind!r}")
        if self.kind == "replay" and not self.captures:
            raise ValueError("the replay backend needs at least one capture")

    def build(self, node_id: str) -> Backend:
        if self.kind == "nvml":
            from collector.nvml import LiveBackend

            return LiveBackend()
        from collector.replay import ReplayBackend

        return ReplayBackend(
            self.captures, self.gpus, node_id=node_id, origin_ns=self.origin_ns, speed=self.speed
        )

"""What a capture's metadata must hold before a replay plays it.

Captures are files anyone can edit or forge; each check here names the first field that is not
what a replay reads, so a bad file fails at load with one line, not mid-run. The strings a
replay prints (the device's uuid, name and driver) are made inert here, once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from collector.model.errors import StepmemError
from collector.model.records import STEP_EVENT_KINDS, StepEvent
from collector.model.step import MAX_BYTES
from collector.model.untrusted import inert

MAX_EVENT_AFTER_NS = 600 * 1_000_000_000  # events may trail the last sample by this much


class CaptureError(StepmemError, ValueError):
    """A capture file that is missing, unreadable or not a stepmem capture."""


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_meta(meta: Any, path: Path) -> None:
    """Raise :class:`CaptureError` naming the first field of a capture's metadata that is not
    what a replay reads."""
    bad = f"capture {path} has bad metadata:"
    if not isinstance(meta, dict):
        raise CaptureError(f"{bad} a JSON object was expected, got {type(meta).__name__}")
    dev = meta.get("device")
    if not isinstance(dev, dict):
        raise CaptureError(f"{bad} 'device' must be an object, got {type(dev).__name__}")
    _check_device(dev, bad)
    rate = meta.get("rate_hz", 0)
    if not isinstance(rate, int | float) or isinstance(rate, bool) or not 0 <= rate < 1e7:
        raise CaptureError(f"{bad} rate_hz must be a number of Hz (0: max)")
    for key, kind in (("events", list), ("processes", list), ("notes", dict)):
        if not isinstance(meta.get(key, kind()), kind):
            raise CaptureError(f"{bad} '{key}' must be a {'list' if kind is list else 'mapping'}")
    for i, ev in enumerate(meta.get("events", [])):
        _check_event(ev, dev["uuid"], f"{bad} events[{i}]")
    for i, snap in enumerate(meta.get("processes", [])):
        _check_snapshot(snap, dev["total_bytes"], f"{bad} processes[{i}]")


def _check_device(dev: dict[str, Any], bad: str) -> None:
    if not isinstance(dev.get("uuid"), str) or not dev["uuid"]:
        raise CaptureError(f"{bad} device.uuid must be a non-empty string")
    if not is_int(dev.get("total_bytes")) or not 0 < dev["total_bytes"] <= MAX_BYTES:
        raise CaptureError(
            f"{bad} device.total_bytes must be a positive integer of at most 2^53 (8 PiB)"
        )
    if dev.get("memory_info_version", 2) not in (1, 2):
        raise CaptureError(f"{bad} device.memory_info_version must be 1 or 2")
    for k in ("uuid", "name", "driver"):  # printed (the sampler's line, the report): inert
        if k in dev and not isinstance(dev[k], str):
            raise CaptureError(f"{bad} device.{k} must be a string")
        if k in dev:
            dev[k] = inert(dev[k], 256)


def _check_event(ev: Any, uuid: str, where: str) -> None:
    if not isinstance(ev, dict):
        raise CaptureError(f"{where} is not an object")
    if ev.get("kind") not in STEP_EVENT_KINDS:
        raise CaptureError(f"{where}.kind {ev.get('kind')!r} is not one of {STEP_EVENT_KINDS}")
    for k in ("step", "t_ns"):
        if not is_int(ev.get(k)) or ev[k] < 0:
            raise CaptureError(f"{where}.{k} is missing or not a non-negative integer")
    for k in ("torch", "ledger"):
        if not isinstance(ev.get(k, {}), dict):
            raise CaptureError(f"{where}.{k} must be a mapping")
    try:  # every field as a sampler will check it: a bad value fails here, not mid-run
        StepEvent.from_dict({"gpu_uuid": uuid, **ev, "t_ns": ev["t_ns"] + 1})
    except (ValueError, TypeError) as exc:
        raise CaptureError(f"{where}: {exc}") from None


def _check_snapshot(snap: Any, total: int, where: str) -> None:
    if not (
        isinstance(snap, dict)
        and is_int(snap.get("t_ns"))
        and snap["t_ns"] >= 0
        and isinstance(snap.get("procs"), list)
    ):
        raise CaptureError(f"{where} must have an integer t_ns and a procs list")
    for p in snap["procs"]:
        if not (
            isinstance(p, list)
            and len(p) >= 2
            and is_int(p[0])
            and p[0] >= 0
            and (p[1] is None or (is_int(p[1]) and 0 <= p[1] <= total))
            and (len(p) < 3 or isinstance(p[2], str))
        ):
            raise CaptureError(
                f"{where}.procs holds {str(p)[:60]!r}: each must be [pid, used bytes or null, name]"
            )


def check_events(events: list[dict[str, Any]], duration: int, path: Path) -> None:
    """Refuse an event far past the samples' end, and a step whose end comes before its begin
    (an edited capture, a probe on a skewed clock): played, it would be dropped without a word.
    Steps are paired per process by their ``seq`` (or, before captures had one, by their order
    in the file)."""
    begun: dict[tuple[Any, ...], int] = {}
    for i, ev in enumerate(events):
        if ev["t_ns"] > duration + MAX_EVENT_AFTER_NS:
            raise CaptureError(
                f"capture {path}: events[{i}] is at {ev['t_ns'] / 1e9:.0f} s, far past the "
                f"samples' end ({duration / 1e9:.1f} s)"
            )
        key = (ev.get("pid", 0), ev.get("seq") or 0, ev["step"])
        if ev["kind"] == "begin":
            begun[key] = int(ev["t_ns"])
        elif ev["kind"] == "end" and key in begun and int(ev["t_ns"]) < begun.pop(key):
            raise CaptureError(
                f"capture {path}: events[{i}], the end of step {ev['step']}, comes before its "
                "begin (an edited capture, or a clock that went back)"
            )

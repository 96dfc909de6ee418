"""The GPUs an estimate can be held against: each one's memory as ``nvidia-smi`` reports it, and
what a training process holds on it outside torch's allocator (the CUDA context, the kernels
loaded on first use, cuBLAS's handles) — measured by stepmem on real GPUs, or by
``stepmem devices --calibrate`` on the user's own and kept in a calibration file.

Only the H200's outside-torch figure was measured by stepmem (``benchmarks/results/fit``); for
another model the H200's figure is assumed and the estimate says so until that GPU is
calibrated. The figure depends on the driver, the CUDA runtime and torch (which kernels load
lazily), so a calibration records all three.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from collector.model.errors import EstimateError
from collector.model.files import atomic_write
from collector.model.units import GIB, MIB
from collector.model.untrusted import inert, read_json

__all__ = [
    "CALIBRATION_ENV",
    "DRIVER_RESERVED",
    "GPUS",
    "Calibration",
    "Card",
    "calibration_path",
    "card",
    "load_calibrations",
    "local_card",
    "save_calibration",
]

CALIBRATION_ENV = "STEPMEM_CALIBRATION"  # the calibration file (default: ~/.config/stepmem/…)
MAX_CALIBRATION_BYTES = 1 << 20


@dataclass(frozen=True)
class Calibration:
    """What one training process held on one GPU model outside torch's allocator."""

    gpu: str  # NVML's name ("NVIDIA H200")
    outside_torch: int  # bytes: NVML used by the process − torch reserved, after a training step
    at_start: int  # of which present once the CUDA context exists (the rest on first use)
    driver: str = ""
    cuda: str = ""
    torch: str = ""
    source: str = ""  # how it was measured


# nvidia-smi's memory total (MiB): the H200's read by stepmem on the device machine
# (benchmarks/results/fit/env.txt); the others as nvidia-smi reports them on those cards
# (the data-centre ones listed in modal-labs/modal-client#2797; the RTX 3090, 4090, 5090 and
# A6000 from nvidia-smi tables users posted: noonghunna/club-3090#1128, RLinf/RLinf#255,
# noonghunna/club-3090#1261 and #1047), not measured by stepmem.
GPUS: dict[str, tuple[str, int]] = {
    "H200": ("NVIDIA H200", 143771 * MIB),
    "H100-80GB": ("NVIDIA H100 80GB HBM3", 81559 * MIB),
    "A100-80GB": ("NVIDIA A100-SXM4-80GB", 81920 * MIB),
    "A100-40GB": ("NVIDIA A100-SXM4-40GB", 40960 * MIB),
    "L40S": ("NVIDIA L40S", 46068 * MIB),
    "A10": ("NVIDIA A10", 23028 * MIB),
    "L4": ("NVIDIA L4", 23034 * MIB),
    "T4": ("Tesla T4", 15360 * MIB),
    "RTX-3090": ("NVIDIA GeForce RTX 3090", 24576 * MIB),
    "RTX-4090": ("NVIDIA GeForce RTX 4090", 24564 * MIB),
    "RTX-5090": ("NVIDIA GeForce RTX 5090", 32607 * MIB),
    "A6000": ("NVIDIA RTX A6000", 49140 * MIB),
}
BARE_GIB = 512  # a bare number above this is not a size (a model number?): it needs "GiB"

# Measured by stepmem on the H200 (driver 580.159.04, CUDA 13.0, torch 2.11): a training
# process's memory outside torch after its first steps, by `stepmem devices --calibrate`
# (benchmarks/results/fit/calibration.json). The benchmark's runs agree: NVML used − torch
# reserved at their step ends is 0.749 GiB (7B, Qwen2, GPT-2 rows), 0.734 GiB (3B), and
# 0.802 GiB under FSDP2 with NCCL's buffers.
MEASURED = (
    Calibration(
        gpu="NVIDIA H200",
        outside_torch=804061184,
        at_start=648871936,
        driver="580.159.04",
        cuda="13.0",
        torch="2.11.0+cu130",
        source="stepmem devices --calibrate on the H200, benchmarks/results/fit",
    ),
)
# What the driver keeps of the card for itself, no process can have it: NVML v2's "reserved",
# and the difference between nvidia-smi's total and the total CUDA reports. 644,939,776 bytes on
# the H200 (both, in every record of benchmarks/results/fit: nvidia-smi rounds it to 616 MiB);
# assumed on the other cards.
DRIVER_RESERVED = 644_939_776


@dataclass(frozen=True)
class Card:
    """A GPU an estimate is held against: its name, its memory, and the outside-torch figure
    used for it with where that figure came from."""

    name: str
    capacity: int  # bytes, nvidia-smi's total
    outside_torch: int
    outside_source: str
    assumed: bool  # the outside-torch figure is another GPU's
    driver_reserved: int = DRIVER_RESERVED  # the card's memory no process can have

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def calibration_path() -> Path:
    env = os.environ.get(CALIBRATION_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "stepmem" / "calibration.json"


def _calibration(d: Any) -> Calibration | None:
    if not isinstance(d, dict):
        return None
    try:
        c = Calibration(
            gpu=inert(str(d["gpu"]))[:128],
            outside_torch=int(d["outside_torch"]),
            at_start=int(d.get("at_start", 0)),
            driver=str(d.get("driver", ""))[:64],
            cuda=str(d.get("cuda", ""))[:64],
            torch=str(d.get("torch", ""))[:64],
            source=inert(str(d.get("source", "")))[:256],
        )
    except (KeyError, TypeError, ValueError):
        return None
    if not 0 <= c.outside_torch <= 64 * GIB or not 0 <= c.at_start <= c.outside_torch:
        return None
    return c


def load_calibrations(path: Path | None = None) -> list[Calibration]:
    """The calibrations kept on this machine (none when the file is missing); a file that is
    not one is an :class:`EstimateError`."""
    path = path or calibration_path()
    try:
        data = read_json(path, MAX_CALIBRATION_BYTES, f"calibration {path}")
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise EstimateError(f"calibration {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise EstimateError(str(exc)) from None
    items = data.get("calibrations") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise EstimateError(f"calibration {path}: not a stepmem calibration file")
    return [c for c in (_calibration(x) for x in items[:256]) if c is not None]


def save_calibration(c: Calibration, path: Path | None = None) -> Path:
    """Keep ``c`` (replacing an earlier one of the same GPU, driver and torch)."""
    path = path or calibration_path()
    try:
        kept = load_calibrations(path)
    except EstimateError:
        kept = []
    kept = [k for k in kept if (k.gpu, k.driver, k.torch) != (c.gpu, c.driver, c.torch)]
    kept.append(c)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({"calibrations": [asdict(k) for k in kept]}, indent=1) + "\n")
    return path


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _lookup(name: str) -> tuple[str, int] | None:
    want = _key(name)
    for short, (full, capacity) in GPUS.items():
        if want in (_key(short), _key(full)):
            return full, capacity
    return None


def _outside(full: str, calibrations: list[Calibration]) -> tuple[Calibration, bool]:
    """The calibration for GPU ``full``: the user's newest, else stepmem's, else the H200's
    (assumed)."""
    mine = [c for c in calibrations if _key(c.gpu) == _key(full)]
    if mine:
        return mine[-1], False
    ours = [c for c in MEASURED if _key(c.gpu) == _key(full)]
    if ours:
        return ours[0], False
    return MEASURED[0], True


def card(spec: str, calibrations: list[Calibration] | None = None) -> Card:
    """The card ``--gpu`` names: a name from :data:`GPUS` (``H100-80GB``, ``L4``, …; NVML's full
    name works too) or a size in GiB (``40``, ``23.5``); :class:`EstimateError` otherwise."""
    text = str(spec).strip()
    cals = load_calibrations() if calibrations is None else calibrations
    try:
        gib = float(text.removesuffix("GiB").removesuffix("gib").strip())
    except ValueError:
        gib = None
    if gib is not None:
        if gib > BARE_GIB and not text.lower().endswith("gib"):
            like = [k for k in GPUS if _key(k).endswith(_key(text))]
            raise EstimateError(
                f"--gpu {text}: a GPU name or a size? "
                + (f"the card is {like[0]}; " if like else "")
                + f"a size above {BARE_GIB} GiB is written with its unit ({text}GiB)"
            )
        if not 1 <= gib <= 4096:
            raise EstimateError(f"--gpu {text}: a size in GiB from 1 to 4096, or a GPU name")
        c, _ = _outside("", cals)
        return Card(
            f"{gib:g} GiB",
            int(gib * GIB),
            c.outside_torch,
            f"{c.gpu}'s ({c.source})",
            assumed=True,
        )
    found = _lookup(text)
    if found is None:
        raise EstimateError(
            f"--gpu {text}: not a GPU stepmem knows; one of {', '.join(GPUS)} or a size in GiB"
        )
    full, capacity = found
    c, assumed = _outside(full, cals)
    return Card(full, capacity, c.outside_torch, f"{c.gpu} ({c.source})", assumed)


def local_card(index: int | None = None) -> Card:
    """This machine's GPU (torch's current one) as a card: by its name when stepmem knows it,
    else by its size (CUDA's total and what the driver keeps)."""
    import torch

    dev = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(dev)
    try:
        return card(props.name)
    except EstimateError:
        return card(f"{(props.total_memory + DRIVER_RESERVED) / GIB:.3f}")

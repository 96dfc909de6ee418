"""The caching allocator's settings and size rules: ``PYTORCH_CUDA_ALLOC_CONF`` parsed as torch
parses it (and refused where torch would refuse it), ``round_size`` and the segment a request
takes (``get_allocation_size``), with the constants of ``c10/cuda/CUDACachingAllocator.cpp``."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from collector.model.errors import EstimateError
from collector.model.units import MIB

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MIB  # kSmallSize: the largest "small" request
SMALL_BUFFER = 2 * MIB  # kSmallBuffer: a small-pool segment
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc: requests under this may share a 20 MiB segment
LARGE_BUFFER = 20 * MIB  # kLargeBuffer
ROUND_LARGE = 2 * MIB  # kRoundLarge: larger requests rounded up to this
NO_LIMIT = 1 << 62
DIVISION_INTERVALS = 16  # roundup_power2_divisions: 1 MiB … 32 GiB, by power of 2
_KNOWN = {
    "max_split_size_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "expandable_segments",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "backend",
}


@dataclass(frozen=True)
class AllocatorConfig:
    """The settings that change the policy (``PYTORCH_CUDA_ALLOC_CONF``): ``max_split_size``
    in bytes (None: unlimited), ``roundup_power2_divisions`` per power-of-2 interval from 1 MiB
    up (all 0: plain 512-byte rounding), ``garbage_collection_threshold`` (0: off),
    ``expandable_segments``."""

    max_split_size: int | None = None
    roundup_power2_divisions: tuple[int, ...] = (0,) * DIVISION_INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    source: str = field(default="torch's defaults", compare=False)  # where they were read

    @classmethod
    def parse(cls, conf: str, source: str = "") -> AllocatorConfig:
        """The settings of a ``PYTORCH_CUDA_ALLOC_CONF`` string (``key:value,key:value``);
        :class:`EstimateError` for what torch would refuse, one line naming it."""
        kw: dict[str, Any] = {}
        for item in filter(None, (x.strip() for x in conf.replace(" ", "").split(","))):
            key, sep, value = item.partition(":")
            if key not in _KNOWN or (not sep and key != "backend"):
                raise EstimateError(f"allocator setting {item!r}: torch does not know it")
            if key == "backend" and value not in ("", "native"):
                raise EstimateError(
                    f"allocator setting {item!r}: only torch's own caching allocator (backend "
                    "native) is modelled; CUDA's cudaMallocAsync pools memory by other rules, so "
                    "an estimate of it would be the caching allocator's figures under its name"
                )
            if key == "max_split_size_mb":
                mb = _number(value, key)
                if mb <= LARGE_BUFFER // MIB:
                    raise EstimateError(
                        f"max_split_size_mb {value}: torch requires more than {LARGE_BUFFER // MIB}"
                    )
                kw["max_split_size"] = int(mb) * MIB
            elif key == "garbage_collection_threshold":
                t = _number(value, key)
                if not 0.0 < t < 1.0:
                    raise EstimateError(
                        f"garbage_collection_threshold {value}: torch requires 0 < it < 1"
                    )
                kw["garbage_collection_threshold"] = t
            elif key == "roundup_power2_divisions":
                kw["roundup_power2_divisions"] = _divisions(value)
            elif key == "expandable_segments":
                if value not in ("True", "False"):
                    raise EstimateError(f"expandable_segments {value!r}: True or False")
                kw["expandable_segments"] = value == "True"
        if source and conf.strip():
            kw["source"] = source
        return cls(**kw)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> AllocatorConfig:
        """The settings this process's torch would read: ``PYTORCH_CUDA_ALLOC_CONF``, else
        ``PYTORCH_ALLOC_CONF`` (``c10/cuda/CUDAAllocatorConfig.h``'s order)."""
        env = os.environ if env is None else env
        name = "PYTORCH_CUDA_ALLOC_CONF"
        conf = env.get(name)
        if conf is None:
            name = "PYTORCH_ALLOC_CONF"
            conf = env.get(name)
        try:
            return cls.parse(conf or "", name)
        except EstimateError as exc:
            raise EstimateError(f"{name}: {exc}") from None

    @classmethod
    def from_snapshot(cls, settings: dict[str, Any]) -> AllocatorConfig:
        """The settings a memory snapshot recorded (``allocator_settings``)."""
        split = settings.get("max_split_size", -1)
        div = settings.get("roundup_power2_divisions") or {}
        divisions = tuple(int(div.get(str(1 << i), 0)) for i in range(DIVISION_INTERVALS))
        return cls(
            max_split_size=None if split is None or int(split) < 0 else int(split),
            roundup_power2_divisions=divisions,
            garbage_collection_threshold=float(settings.get("garbage_collection_threshold", 0)),
            expandable_segments=bool(settings.get("expandable_segments", False)),
            source="the history's settings",
        )

    def describe(self) -> str:
        """The settings in words, for the estimate to say what it assumed."""
        parts = [
            "expandable segments" if self.expandable_segments else "cudaMalloc segments",
            f"max_split_size {self.max_split_size // MIB} MiB"
            if self.max_split_size
            else "no max_split_size",
        ]
        if any(self.roundup_power2_divisions):
            parts.append(f"roundup_power2_divisions {list(self.roundup_power2_divisions)}")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold {self.garbage_collection_threshold:g}")
        return ", ".join(parts) + f" ({self.source})"

    @property
    def split_limit(self) -> int:
        return self.max_split_size if self.max_split_size else NO_LIMIT


def _number(value: str, key: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise EstimateError(f"{key} {value!r}: not a number") from None
    if not math.isfinite(v):
        raise EstimateError(f"{key} {value!r}: not a number")
    return v


def _divisions(value: str) -> tuple[int, ...]:
    """``4`` (every interval) or ``[256:1,512:2,>:4]`` (per interval, MiB), each a power of 2."""

    def check(n: str) -> int:
        d = int(_number(n, "roundup_power2_divisions"))
        if d != 0 and (d < 1 or d & (d - 1)):
            raise EstimateError(f"roundup_power2_divisions {n}: a power of 2")
        return d

    if not value.startswith("["):
        return (check(value),) * DIVISION_INTERVALS
    out = [0] * DIVISION_INTERVALS
    last = 0
    for item in value.strip("[]").split(","):
        size, _, n = item.partition(":")
        d = check(n)
        if size == ">":
            for i in range(last, DIVISION_INTERVALS):
                out[i] = d
            continue
        mb = int(_number(size, "roundup_power2_divisions"))
        if mb <= 0 or mb & (mb - 1):
            raise EstimateError(f"roundup_power2_divisions interval {size}: a power of 2 (MiB)")
        i = min(DIVISION_INTERVALS - 1, int(math.log2(mb)))
        for j in range(last, i + 1):
            out[j] = d
        last = i + 1
    return tuple(out)


def round_size(size: int, config: AllocatorConfig | None = None) -> int:
    """The size a request of ``size`` bytes takes (``round_size``)."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    config = config or AllocatorConfig()
    divisions = config.roundup_power2_divisions[
        min(DIVISION_INTERVALS - 1, max(0, (size >> 20).bit_length() - 1))
    ]
    if divisions > 1 and size > MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        base = size & ~(step - 1)
        return size if base == size else base + step
    return MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)


def allocation_size(size: int) -> int:
    """The segment a new block for a rounded request of ``size`` takes (``get_allocation_size``)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)

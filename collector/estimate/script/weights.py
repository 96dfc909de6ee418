"""A model's weights as shapes: ``safetensors.safe_open`` answered from the file's header.

A script under the estimate loads its model as it always does (``from_pretrained`` of a local
folder, ``safetensors.torch.load_file``), but no weight is read: :class:`HeaderOnly` reads a
file's header (its first 8 bytes give the header's length, the JSON header gives every tensor's
dtype and shape) and hands out fake tensors of those shapes on the ``meta`` device, which the
script's own ``.to(device)`` puts on the GPU as a real load does (a checkpoint's host copy is
not GPU memory). The header is untrusted data: its size is bounded, its entries checked.
"""

from __future__ import annotations

import contextlib
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from collector.model.errors import EstimateError
from collector.model.untrusted import loads_json

__all__ = ["HeaderOnly", "headers_only", "read_header"]

MAX_HEADER = 100 << 20  # safetensors' own bound on a header
DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def read_header(path: str | Path) -> tuple[dict[str, tuple[str, list[int]]], dict[str, str]]:
    """A safetensors file's tensors (name → (dtype, shape)) and metadata, from its header."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise EstimateError(f"{path}: not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise EstimateError(f"{path}: a header of {n} bytes (at most {MAX_HEADER})")
        raw = f.read(n)
    try:  # a file anyone may hand the script: bounded in depth, one line when it is bad
        header = loads_json(raw, f"{path}: its header")
    except ValueError as exc:
        raise EstimateError(str(exc)) from None
    if not isinstance(header, dict):
        raise EstimateError(f"{path}: its header is not an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise EstimateError(f"{path}: its header's __metadata__ is not an object of strings")
    tensors = {}
    for name, entry in header.items():
        entry = entry if isinstance(entry, dict) else {}
        dtype, shape = entry.get("dtype"), entry.get("shape")
        if dtype not in DTYPES or not isinstance(shape, list):
            raise EstimateError(f"{path}: tensor {str(name)[:80]!r}: dtype or shape unreadable")
        if not all(isinstance(d, int) and 0 <= d < 1 << 40 for d in shape):
            raise EstimateError(f"{path}: tensor {str(name)[:80]!r}: a bad shape")
        tensors[str(name)] = (dtype, shape)
    return tensors, {str(k): str(v) for k, v in meta.items()}  # the script's own, as given


class _Slice:
    """What ``safe_open(...).get_slice(name)`` returns: shape and dtype, indexable."""

    def __init__(self, dtype: str, shape: list[int]) -> None:
        self.dtype, self.shape = dtype, shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype

    def tensor(self) -> Any:
        import torch

        return torch.empty(self.shape, dtype=getattr(torch, DTYPES[self.dtype]), device="meta")

    def __getitem__(self, index: Any) -> Any:
        return self.tensor()[index]


class HeaderOnly:
    """``safetensors.safe_open`` for a script under the estimate (see the module doc)."""

    def __init__(self, filename: Any, framework: str = "pt", device: Any = "cpu", **_: Any):
        self.filename = str(filename)
        self.tensors, self.meta = read_header(self.filename)

    def __enter__(self) -> HeaderOnly:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def keys(self) -> list[str]:
        return list(self.tensors)

    def offset_keys(self) -> list[str]:
        return list(self.tensors)

    def metadata(self) -> dict[str, str]:
        return dict(self.meta)

    def get_slice(self, name: str) -> _Slice:
        return _Slice(*self.tensors[name])

    def get_tensor(self, name: str) -> Any:
        return _Slice(*self.tensors[name]).tensor()


def _load_file(filename: Any, device: Any = "cpu") -> dict[str, Any]:
    f = HeaderOnly(filename)
    return {k: f.get_tensor(k) for k in f.tensors}


@contextlib.contextmanager
def headers_only() -> Iterator[None]:
    """For the duration, ``safe_open`` and ``safetensors.torch.load_file`` read headers only —
    in safetensors and in every module already holding them by name."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError:  # nothing to load weights with: nothing to answer
        yield
        return

    real_open, real_load = safetensors.safe_open, safetensors.torch.load_file
    swaps = {real_open: HeaderOnly, real_load: _load_file}
    undo: list[tuple[Any, str, Any]] = []
    for mod in list(sys.modules.values()):
        for name in ("safe_open", "load_file"):
            held = getattr(mod, name, None) if mod is not None else None
            if held is not None and any(held is r for r in swaps):
                undo.append((mod, name, held))
                setattr(mod, name, swaps[held])
    try:
        yield
    finally:
        for mod, name, held in undo:
            setattr(mod, name, held)

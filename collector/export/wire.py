"""The remote-write 1.0 message, encoded by hand: ``WriteRequest`` has three tiny types, so
they are written here as protobuf bytes rather than through generated code and a ``protoc`` step.
Compression (snappy's block format) and sending are :mod:`collector.export.remote_write`'s."""

from __future__ import annotations

import struct

Series = tuple[tuple[str, str], ...]  # sorted (label, value) pairs, __name__ included
# Prometheus' staleness marker: a NaN with this exact bit pattern ends a series
STALE_NAN_BITS = 0x7FF0000000000002


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1  # int64 two's complement, as protobuf encodes negative int64
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field_bytes(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def encode_write_request(series: dict[Series, list[tuple[int, float]]]) -> bytes:
    """``WriteRequest{timeseries: [TimeSeries{labels: [Label{name, value}],
    samples: [Sample{value: double, timestamp: int64 ms}]}]}`` as protobuf bytes."""
    out = bytearray()
    for labels, samples in series.items():
        ts = bytearray()
        for name, value in labels:
            ts += _field_bytes(1, _field_bytes(1, name.encode()) + _field_bytes(2, value.encode()))
        for t_ms, value in samples:
            # a NaN is only ever pushed as the stale marker: send its exact bits
            v = struct.pack("<Q", STALE_NAN_BITS) if value != value else struct.pack("<d", value)
            sample = b"\x09" + v + b"\x10" + _varint(t_ms)
            ts += _field_bytes(2, sample)
        out += _field_bytes(1, bytes(ts))
    return bytes(out)

import numpy as np
import pytest

from collector.sampler import RingBuffer


def fill(ring: RingBuffer, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        ring.append(1_000 + 10 * i, i, 7)


def test_capacity_is_validated():
    with pytest.raises(ValueError, match="capacity"):
        RingBuffer(1)


def test_memory_bound_is_24_bytes_a_sample():
    assert RingBuffer(1000).nbytes == 24_000


def test_snapshot_before_wrap_keeps_everything_in_order():
    r = RingBuffer(8)
    fill(r, 5)
    s = r.snapshot()
    assert s.used.tolist() == [0, 1, 2, 3, 4]
    assert s.reserved.tolist() == [7] * 5
    assert len(r) == 5 and r.last() == (1_040, 4, 7)


def test_wrap_around_keeps_the_newest_capacity_samples():
    r = RingBuffer(8)
    fill(r, 21)
    s = r.snapshot()
    assert s.used.tolist() == list(range(13, 21))
    assert np.all(np.diff(s.t_ns) == 10)
    assert len(r) == 8 and r.count == 21
    assert r.oldest_t_ns() == 1_000 + 10 * 13


def test_since_reports_what_was_overwritten():
    r = RingBuffer(8)
    fill(r, 5)
    w, nxt = r.since(0)
    assert w.used.tolist() == [0, 1, 2, 3, 4] and w.lost == 0 and nxt == 5
    fill(r, 10, start=5)  # 10 more into a ring of 8: samples 5 and 6 are gone
    w, nxt = r.since(nxt)
    assert w.used.tolist() == list(range(7, 15))
    assert w.lost == 2 and nxt == 15
    w, nxt = r.since(nxt)
    assert len(w) == 0 and w.lost == 0


def test_window_is_inclusive_and_copies_only_the_window():
    r = RingBuffer(16)
    fill(r, 40)  # held: i = 24..39, t = 1240..1390
    w = r.window(1_300, 1_350)
    assert w.t_ns.tolist() == [1_300, 1_310, 1_320, 1_330, 1_340, 1_350]
    assert len(r.window(1_000, 1_100)) == 0  # entirely overwritten
    assert len(r.window(2_000, 3_000)) == 0  # in the future
    assert r.window(0, 10**9).used.tolist() == list(range(24, 40))


def test_value_at_and_after():
    r = RingBuffer(16)
    fill(r, 10)
    assert r.value_at(1_055) == (1_050, 5, 7)
    assert r.value_at(1_050) == (1_050, 5, 7)
    assert r.value_after(1_055) == (1_060, 6, 7)
    assert r.value_after(1_060) == (1_060, 6, 7)
    assert r.value_at(999) is None
    assert r.value_after(1_091) is None

"""The caching-allocator model held against the real allocator: every allocation history recorded
on the H200 and committed (steps 1-3 of the fit benchmark's runs and loops, the accounting,
cases and distributed runs) replayed request by request; and the policy's rules one by one, as
``c10/cuda/CUDACachingAllocator.cpp`` states them."""

from __future__ import annotations

import pytest

from collector.analysis.allocator_vs_history import replay_history
from collector.estimate.allocator import (
    AllocatorConfig,
    CachingAllocator,
    OutOfMemory,
    allocation_size,
    round_size,
)
from collector.model.errors import EstimateError
from collector.model.units import GIB, MIB
from tests.records import ROOT

HISTORIES = sorted(
    p
    for p in (ROOT / "benchmarks/results").rglob("history-steps-*.pickle*")
    if p.stat().st_size > 50_000  # the recordings of real steps (not the tiny test stand-ins)
)


def test_the_committed_histories_are_found():
    names = {
        p.parent.parent.name if p.parent.name == "history" else p.parent.name for p in HISTORIES
    }
    # the fit benchmark's six rows and three loops, and the earlier runs
    for want in ("h200-fit-7b-adamw_8bit", "h200-fit-1b-fsdp2", "expandable", "shapes", "small"):
        assert want in names, want
    assert len(HISTORIES) >= 12


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: "/".join(p.parts[-4:-1]))
def test_replaying_a_recorded_history_reproduces_the_real_allocator(path):
    r = replay_history(path)
    assert r.requests > 1000 and r.steps, "a history of real steps"
    # every block at the address the real allocator gave it, every segment at the same request
    assert r.unknown_frees == 0
    assert r.addresses_matched == r.requests
    assert r.segments_model == r.segments_real
    assert r.segments_matched == len(r.segments_real)
    # torch reserved at every step end: within 0.5 % (it is exact on every committed history)
    for s in r.steps:
        assert abs(s.error) <= 0.005, (s.step, s.real, s.model)


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    assert allocation_size(round_size(1 * MIB)) == 2 * MIB  # the small pool's segment
    assert allocation_size(round_size(1 * MIB + 1)) == 20 * MIB  # under 10 MiB: 20 MiB
    assert allocation_size(round_size(10 * MIB)) == 10 * MIB  # from 10 MiB: its own, by 2 MiB
    assert allocation_size(round_size(11 * MIB + 3)) == 12 * MIB
    # roundup_power2_divisions: 4 divisions of [256, 512) MiB → 320 MiB
    four = AllocatorConfig.parse("roundup_power2_divisions:4")
    assert round_size(300 * MIB, four) == 320 * MIB
    assert round_size(256 * MIB, four) == 256 * MIB


def test_best_fit_split_and_merge():
    a = CachingAllocator()
    h1 = a.malloc(4 * MIB)  # a 20 MiB segment, split: 4 used, 16 cached
    assert a.stats.reserved == 20 * MIB and a.stats.allocated == 4 * MIB
    h2 = a.malloc(6 * MIB)  # fits in the rest of that segment
    assert a.stats.reserved == 20 * MIB
    a.free(h1)
    assert a.stats.inactive_split == 4 * MIB + 10 * MIB  # both free pieces of a split segment
    a.free(h2)  # merges back into one free 20 MiB block
    assert a.stats.inactive_split == 0 and a.stats.allocated == 0
    a.empty_cache()
    assert a.stats.reserved == 0


def test_large_blocks_are_not_split_for_a_small_rest():
    a = CachingAllocator()
    h = a.malloc(40 * MIB)
    a.free(h)
    a.malloc(39 * MIB + MIB // 2)  # the rest, 0.5 MiB, is not over 1 MiB: the block is taken whole
    assert a.stats.allocated == 40 * MIB


def test_out_of_memory_frees_the_cache_and_retries_before_failing():
    a = CachingAllocator(limit=100 * MIB)
    h = a.malloc(60 * MIB)
    a.free(h)  # 60 MiB cached
    a.malloc(80 * MIB)  # 60 + 80 > 100: the cached segment is given back, then it fits
    assert a.stats.num_alloc_retries == 0 or a.stats.reserved == 80 * MIB
    assert a.stats.reserved == 80 * MIB
    with pytest.raises(OutOfMemory):
        a.malloc(30 * MIB)


def test_max_split_size_keeps_large_blocks_whole():
    a = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:64"))
    h = a.malloc(100 * MIB)
    a.free(h)
    a.malloc(30 * MIB)  # an oversize block is not used for a request under max_split_size
    assert a.stats.reserved == 100 * MIB + 30 * MIB


def test_expandable_segments_map_pages():
    a = CachingAllocator(AllocatorConfig.parse("expandable_segments:True"))
    h = a.malloc(30 * MIB)
    assert a.stats.reserved == 40 * MIB  # two 20 MiB pages
    a.free(h)
    a.malloc(35 * MIB)  # reuses the mapped pages
    assert a.stats.reserved == 40 * MIB


@pytest.mark.parametrize(
    "conf",
    [
        "max_split_size_mb:10",
        "garbage_collection_threshold:1.5",
        "expandable_segments:yes",
        "roundup_power2_divisions:3",
        "no_such_setting:1",
        "max_split_size_mb:abc",
    ],
)
def test_settings_torch_would_refuse_are_refused(conf):
    with pytest.raises(EstimateError) as exc:
        AllocatorConfig.parse(conf)
    assert "\n" not in str(exc.value)


def test_the_environment_is_read_as_torch_reads_it():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": ""}
    assert AllocatorConfig.from_env(env).expandable_segments
    assert AllocatorConfig.from_env({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}).max_split_size
    assert AllocatorConfig.from_env({}) == AllocatorConfig()
    assert "expandable" in AllocatorConfig.from_env(env).describe()
    assert GIB  # units imported for the figures above

"""PyTorch's CUDA caching allocator, modelled: what a sequence of allocations and frees makes it
reserve from the driver, step by step — the cache and the split blocks no tracker of live tensors
sees.

The policy is ``c10/cuda/CUDACachingAllocator.cpp`` as torch 2.11–2.13 implement it (the
``DeviceCachingAllocator``), one stream or several, without CUDA graphs:

* a request is rounded to 512 bytes (``round_size``; with ``roundup_power2_divisions`` to the
  next of N divisions of its power-of-2 interval) and served from the **small pool** (rounded
  size ≤ 1 MiB) or the **large pool**;
* the **best fit**: the smallest free block of the request's stream and pool at least as large
  (ties: the lowest address), never an oversize block (≥ ``max_split_size``) for a request under
  it, and for an oversize request only a block less than 20 MiB larger;
* no fit: a new **segment** from the driver (``cudaMalloc``) of 2 MiB (small pool), 20 MiB
  (requests under 10 MiB), or the request rounded up to 2 MiB; when the driver refuses (over
  ``limit``), the oversize cached blocks that free enough are released and, failing that, every
  cached segment that is wholly free, and it is tried again (``num_alloc_retries``); failing
  that, the request is out of memory (``num_ooms``);
* a block larger than the request is **split** when the rest is at least 512 bytes (small pool,
  expandable segments) or, in the large pool, more than 1 MiB and the request is under
  ``max_split_size``; a freed block **merges** with free neighbours of its segment;
* ``garbage_collection_threshold`` (with a memory fraction set) frees, before a new segment,
  cached large segments older than the average until reserved is back under the threshold;
* ``expandable_segments``: one segment per pool and stream that grows by mapping pages (2 MiB
  small, 20 MiB large) at the lowest address where the request fits, and gives fully free pages
  back on ``empty_cache`` or before an out of memory.

Addresses are the model's own (increasing, in the order segments are made) unless the caller
gives the driver's (``malloc(..., segment_addr=…)``, as a replay of a recorded history does:
they order blocks of equal size). Pure Python; nothing here touches a GPU.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from collector.estimate.allocator_config import (
    LARGE_BUFFER,
    MIN_BLOCK,
    NO_LIMIT,
    SMALL_BUFFER,
    SMALL_SIZE,
    AllocatorConfig,
    allocation_size,
    round_size,
)
from collector.model.units import GIB

__all__ = [
    "AllocatorConfig",
    "AllocatorStats",
    "CachingAllocator",
    "OutOfMemory",
    "round_size",
]


class OutOfMemory(Exception):
    """The model ran out of memory: ``size`` bytes could not be had within the limit."""

    def __init__(self, size: int, reserved: int, allocated: int) -> None:
        super().__init__(f"out of memory: tried to allocate {size} bytes")
        self.size, self.reserved, self.allocated = size, reserved, allocated


@dataclass
class Block:
    addr: int
    size: int
    small: bool
    stream: int
    segment: Segment
    allocated: bool = False
    requested: int = 0
    mapped: bool = True
    prev: Block | None = None
    next: Block | None = None
    gc_base: int = 0  # the pool's free-block lookups when it was cached (its age, for GC)

    @property
    def split(self) -> bool:
        return self.prev is not None or self.next is not None

    def key(self) -> tuple[int, int, int]:
        return (self.stream, self.size, self.addr)


@dataclass(eq=False)
class Segment:
    addr: int
    size: int
    small: bool
    stream: int
    expandable: bool = False
    page: int = 0  # expandable: the mapping granularity


@dataclass
class AllocatorStats:
    """What ``torch.cuda.memory_stats`` would say (the aggregate pool), and the peaks since the
    last :meth:`CachingAllocator.reset_peaks`."""

    allocated: int = 0
    reserved: int = 0
    active: int = 0
    inactive_split: int = 0
    segments: int = 0
    allocated_peak: int = 0
    reserved_peak: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0
    num_device_alloc: int = 0
    num_device_free: int = 0
    requested: int = 0


@dataclass
class _Pool:
    small: bool
    keys: list[tuple[int, int, int]] = field(default_factory=list)  # free mapped blocks, sorted
    blocks: dict[tuple[int, int, int], Block] = field(default_factory=dict)
    unmapped: list[Block] = field(default_factory=list)  # expandable: unmapped ranges
    lookups: int = 0  # get_free_block calls (block age, for garbage collection)

    def insert(self, b: Block) -> None:
        k = b.key()
        bisect.insort(self.keys, k)
        self.blocks[k] = b
        b.gc_base = self.lookups

    def remove(self, b: Block) -> None:
        k = b.key()
        i = bisect.bisect_left(self.keys, k)
        if i < len(self.keys) and self.keys[i] == k:
            del self.keys[i]
            del self.blocks[k]


class CachingAllocator:
    """One device's caching allocator (see the module docstring). ``limit``: the bytes the driver
    lets torch hold (None: no limit); ``fraction``: that limit comes from
    ``set_per_process_memory_fraction`` (the garbage collector's switch). ``events`` lists what
    reached the driver: ``(kind, addr, size)`` with kind ``segment_alloc``, ``segment_free``,
    ``segment_map`` or ``segment_unmap``."""

    def __init__(
        self,
        config: AllocatorConfig | None = None,
        limit: int | None = None,
        fraction: bool = False,
        keep_events: bool = False,
    ) -> None:
        self.config = config or AllocatorConfig()
        self.limit = NO_LIMIT if limit is None else int(limit)
        self.fraction = fraction
        self.stats = AllocatorStats()
        self.small = _Pool(True)
        self.large = _Pool(False)
        self.live: dict[int, Block] = {}  # handle → allocated block
        self.segments: list[Segment] = []
        self.events: list[tuple[str, int, int]] = [] if keep_events else None  # type: ignore[assignment]
        self._next_handle = 1
        self._next_addr = 1 << 40
        self._expandable: dict[tuple[bool, int], Segment] = {}

    # -- the public face -----------------------------------------------------------------------

    def malloc(self, size: int, stream: int = 0, segment_addr: int | None = None) -> int:
        """Allocate ``size`` bytes on ``stream``; returns a handle for :meth:`free`. Raises
        :class:`OutOfMemory` when the limit allows no block for it. ``segment_addr``: the
        address the driver gives a new segment, if this request makes one (a replay)."""
        rounded = round_size(int(size), self.config)
        pool = self.small if rounded <= SMALL_SIZE else self.large
        block = self._free_block(pool, stream, rounded)
        if block is None:
            block = self._new_block(pool, stream, rounded, segment_addr)
        if self._should_split(block, rounded):
            block = self._split(block, rounded, pool)
        elif block.split:
            self.stats.inactive_split -= block.size if not block.segment.expandable else 0
        block.allocated = True
        block.requested = int(size)
        handle = self._next_handle
        self._next_handle += 1
        self.live[handle] = block
        s = self.stats
        s.allocated += block.size
        s.active += block.size
        s.requested += block.requested
        s.allocated_peak = max(s.allocated_peak, s.allocated)
        return handle

    def free(self, handle: int) -> None:
        block = self.live.pop(handle)
        block.allocated = False
        s = self.stats
        s.allocated -= block.size
        s.active -= block.size
        s.requested -= block.requested
        pool = self.small if block.small else self.large
        for other in (block.prev, block.next):
            merged = self._merge(block, other, pool)
            if merged and not block.segment.expandable:
                s.inactive_split -= merged
        pool.insert(block)
        if block.split and not block.segment.expandable:
            s.inactive_split += block.size

    def address(self, handle: int) -> int:
        return self.live[handle].addr

    def adopt_segment(
        self, addr: int, size: int, stream: int, live: list[tuple[int, int, int]]
    ) -> dict[int, int]:
        """A segment the driver gave before this model began (a replay that starts mid-run),
        with its ``live`` blocks ``(addr, size, requested)``; the rest of it is cached free.
        Returns each live block's handle by address."""
        small = size <= SMALL_BUFFER and all(b[1] <= SMALL_SIZE for b in live)
        seg = Segment(addr, size, small, stream)
        self.segments.append(seg)
        self.stats.segments += 1
        return self._adopt(seg, size, live)

    def adopt_expandable(
        self, addr: int, mapped: int, stream: int, small: bool, live: list[tuple[int, int, int]]
    ) -> dict[int, int]:
        """The expandable segment of a pool and stream as it stood before this model began:
        ``mapped`` bytes from ``addr`` (its ``live`` blocks, the rest free), unmapped after."""
        page = SMALL_BUFFER if small else LARGE_BUFFER
        seg = Segment(addr, 1 << 44, small, stream, True, page)
        self._expandable[(small, stream)] = seg
        return self._adopt(seg, mapped, live)

    def _adopt(self, seg: Segment, mapped: int, live: list[tuple[int, int, int]]) -> dict[int, int]:
        """``seg``'s first ``mapped`` bytes: ``live`` blocks allocated, the gaps free (and, for
        an expandable segment, the rest of it unmapped)."""
        pool = self.small if seg.small else self.large
        self.stats.reserved += mapped
        self.stats.reserved_peak = max(self.stats.reserved_peak, self.stats.reserved)
        pieces: list[tuple[int, int, int | None]] = []
        at, end = seg.addr, seg.addr + mapped
        for a, sz, req in sorted(live):
            if a > at:
                pieces.append((at, a - at, None))
            pieces.append((a, sz, req))
            at = a + sz
        if at < end:
            pieces.append((at, end - at, None))
        blocks = [Block(a, sz, seg.small, seg.stream, seg) for a, sz, _ in pieces]
        if seg.expandable and end < seg.addr + seg.size:
            blocks.append(
                Block(end, seg.addr + seg.size - end, seg.small, seg.stream, seg, mapped=False)
            )
        for x, y in itertools.pairwise(blocks):
            x.next, y.prev = y, x
        handles = {}
        for b, (_, _, req) in itertools.zip_longest(blocks, pieces, fillvalue=(0, 0, None)):
            if not b.mapped:
                pool.unmapped.append(b)
                continue
            if req is None:
                pool.insert(b)
                if b.split and not seg.expandable:
                    self.stats.inactive_split += b.size
                continue
            b.allocated, b.requested = True, req
            handles[b.addr] = h = self._next_handle
            self._next_handle += 1
            self.live[h] = b
            self.stats.allocated += b.size
            self.stats.active += b.size
            self.stats.requested += req
        self.stats.allocated_peak = max(self.stats.allocated_peak, self.stats.allocated)
        return handles

    def release_segment(self, addr: int) -> bool:
        """Give back the segment at ``addr`` if it is wholly free (what ``empty_cache`` does
        to each such segment); False when it is not (or the model has none there)."""
        for pool in (self.large, self.small):
            for b in list(pool.blocks.values()):
                if b.addr == addr and not b.split and not b.segment.expandable:
                    self._release(b, pool)
                    return True
        return False

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: every wholly free segment back to the driver (free
        pages of expandable segments unmapped)."""
        self._release_blocks(self.large)
        self._release_blocks(self.small)

    def reset_peaks(self) -> None:
        self.stats.allocated_peak = self.stats.allocated
        self.stats.reserved_peak = self.stats.reserved

    @property
    def inactive_split(self) -> int:
        return self.stats.inactive_split

    # -- finding a block -----------------------------------------------------------------------

    def _free_block(self, pool: _Pool, stream: int, size: int) -> Block | None:
        if self.fraction and self.config.garbage_collection_threshold > 0:
            pool.lookups += 1
        i = bisect.bisect_left(pool.keys, (stream, size, 0))
        if i >= len(pool.keys) or pool.keys[i][0] != stream:
            return None
        if self.config.expandable_segments:
            i = self._expandable_fit(pool, stream, i)
        b = pool.blocks[pool.keys[i]]
        split_limit = self.config.split_limit
        if size < split_limit and b.size >= split_limit:
            return None  # an oversize block is kept for oversize requests
        if size >= split_limit and b.size >= size + LARGE_BUFFER:
            return None
        pool.remove(b)
        return b

    def _expandable_fit(self, pool: _Pool, stream: int, i: int) -> int:
        """Best fit counts an expandable block as the size it can grow to (its free mapped size
        and the unmapped range after it)."""

        def grows_to(b: Block) -> int:
            nxt = b.next
            return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

        while True:
            b = pool.blocks[pool.keys[i]]
            j = i + 1
            if not b.segment.expandable or j >= len(pool.keys) or pool.keys[j][0] != stream:
                return i
            if grows_to(pool.blocks[pool.keys[j]]) < grows_to(b):
                i = j
                continue
            return i

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK
        return size < self.config.split_limit and remaining > SMALL_SIZE

    def _split(self, block: Block, size: int, pool: _Pool) -> Block:
        """The front ``size`` bytes of ``block`` as a block of its own; the rest stays cached."""
        already = block.split
        front = Block(block.addr, size, block.small, block.stream, block.segment)
        front.prev, front.next = block.prev, block
        if block.prev is not None:
            block.prev.next = front
        block.prev = front
        block.addr += size
        block.size -= size
        pool.insert(block)
        if not block.segment.expandable:
            self.stats.inactive_split += -size if already else block.size
        return front

    def _merge(self, dst: Block, src: Block | None, pool: _Pool) -> int:
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.unmapped.remove(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # -- new memory from the driver ------------------------------------------------------------

    def _new_block(self, pool: _Pool, stream: int, size: int, addr: int | None) -> Block:
        if self.fraction and self.config.garbage_collection_threshold > 0:
            self._garbage_collect()
        block = self._alloc_block(pool, stream, size, addr)
        if block is None and self._release_available(pool, stream, size):
            block = self._alloc_block(pool, stream, size, addr)
        if block is None:
            self._release_blocks(self.large)
            self._release_blocks(self.small)
            self.stats.num_alloc_retries += 1
            block = self._alloc_block(pool, stream, size, addr)
        if block is None:
            self.stats.num_ooms += 1
            raise OutOfMemory(allocation_size(size), self.stats.reserved, self.stats.allocated)
        return block

    def _alloc_block(self, pool: _Pool, stream: int, size: int, addr: int | None) -> Block | None:
        if self.config.expandable_segments:
            return self._expand(pool, stream, size)
        seg_size = allocation_size(size)
        if self.stats.reserved + seg_size > self.limit:
            return None
        if addr is None:
            addr = self._next_addr
            self._next_addr += seg_size + GIB
        seg = Segment(addr, seg_size, pool.small, stream)
        self.segments.append(seg)
        self._reserve(seg_size, "segment_alloc", addr)
        self.stats.segments += 1
        return Block(addr, seg_size, pool.small, stream, seg)

    def _reserve(self, size: int, kind: str, addr: int) -> None:
        s = self.stats
        s.reserved += size
        s.reserved_peak = max(s.reserved_peak, s.reserved)
        s.num_device_alloc += 1
        if self.events is not None:
            self.events.append((kind, addr, size))

    def _unreserve(self, size: int, kind: str, addr: int) -> None:
        self.stats.reserved -= size
        self.stats.num_device_free += 1
        if self.events is not None:
            self.events.append((kind, addr, size))

    def _release_available(self, pool: _Pool, stream: int, size: int) -> bool:
        """Free oversize cached blocks, just enough for ``size`` (only with max_split_size)."""
        limit = self.config.split_limit
        if limit == NO_LIMIT or self.config.expandable_segments:
            return False
        want = max(size, limit)
        i = bisect.bisect_left(pool.keys, (stream, want, 0))
        if i < len(pool.keys) and pool.keys[i][0] == stream:
            self._release(pool.blocks[pool.keys[i]], pool)
            return True
        released = 0
        i -= 1
        while i >= 0 and released < want:
            b = pool.blocks[pool.keys[i]]
            if b.size < limit or b.stream != stream:
                break
            released += b.size
            self._release(b, pool)
            i -= 1
        return released >= want

    def _release_blocks(self, pool: _Pool) -> None:
        for k in list(pool.keys):
            b = pool.blocks.get(k)
            if b is None:
                continue
            if b.segment.expandable:
                self._unmap(b, pool)
            elif not b.split:
                self._release(b, pool)

    def _release(self, b: Block, pool: _Pool) -> None:
        pool.remove(b)
        self.segments.remove(b.segment)
        self.stats.segments -= 1
        self._unreserve(b.size, "segment_free", b.addr)

    def _garbage_collect(self) -> None:
        threshold = int(self.config.garbage_collection_threshold * self.limit)
        if self.stats.reserved <= threshold:
            return
        target = self.stats.reserved - threshold
        pool = self.large
        freeable = [b for b in pool.blocks.values() if not b.split]
        ages = {id(b): pool.lookups - b.gc_base for b in freeable}
        total, count, reclaimed = sum(ages.values()), len(freeable), 0
        freed = True
        while reclaimed < target and freed and count > 0:
            mean = total / count
            freed = False
            for b in [pool.blocks[k] for k in list(pool.keys) if k in pool.blocks]:
                if not b.split and b in freeable and ages[id(b)] >= mean:
                    freed = True
                    reclaimed += b.size
                    total -= ages[id(b)]
                    count -= 1
                    freeable.remove(b)
                    self._release(b, pool)

    # -- expandable segments -------------------------------------------------------------------

    def _expand(self, pool: _Pool, stream: int, size: int) -> Block | None:
        """Map pages at the lowest address of the pool's expandable segment where ``size``
        fits (free mapped blocks followed by unmapped ones), as
        ``try_allocate_expandable_block`` does; None when the limit forbids the pages."""
        seg = self._expandable.get((pool.small, stream))
        if seg is None:
            page = SMALL_BUFFER if pool.small else LARGE_BUFFER
            seg = Segment(self._next_addr, 1 << 44, pool.small, stream, True, page)
            self._next_addr += seg.size
            self._expandable[(pool.small, stream)] = seg
            whole = Block(seg.addr, seg.size, pool.small, stream, seg, mapped=False)
            pool.unmapped.append(whole)
        candidate = self._expandable_candidate(pool, seg, size)
        if candidate is None:
            return None
        if not candidate.mapped and not self._map(candidate, min(candidate.size, size), pool):
            return None
        while candidate.size < size:
            nxt = candidate.next
            assert nxt is not None
            if not self._map(nxt, min(size - candidate.size, nxt.size), pool):
                return None
            candidate = nxt  # mapping merged the free block before it into it
        pool.remove(candidate)
        return candidate

    def _expandable_candidate(self, pool: _Pool, seg: Segment, size: int) -> Block | None:
        def free(b: Block | None) -> bool:
            return b is not None and not b.allocated

        for u in sorted((b for b in pool.unmapped if b.segment is seg), key=lambda b: b.addr):
            c = u.prev if free(u.prev) and u.prev.mapped else u
            room, b = 0, c
            while b is not None and free(b) and room < size:
                room += b.size
                b = b.next
            if room >= size:
                return c
        return None

    def _map(self, b: Block, size: int, pool: _Pool) -> bool:
        page = b.segment.page
        end = b.addr + size
        end += (-(end - b.segment.addr)) % page  # whole pages: the range's end rounded up
        mapped = min(end, b.addr + b.size) - b.addr
        if self.stats.reserved + mapped > self.limit:
            return False
        pool.unmapped.remove(b)
        b.mapped = True
        if mapped < b.size:
            rest = Block(b.addr + mapped, b.size - mapped, b.small, b.stream, b.segment)
            rest.mapped = False
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = mapped
            pool.unmapped.append(rest)
        for other in (b.prev, b.next):
            self._merge(b, other, pool)
        pool.insert(b)
        self._reserve(mapped, "segment_map", b.addr)
        return True

    def _unmap(self, b: Block, pool: _Pool) -> None:
        """Give back the whole pages of a free expandable block."""
        page, base = b.segment.page, b.segment.addr
        lo = b.addr + (-(b.addr - base)) % page
        hi = b.addr + b.size - (b.addr + b.size - base) % page
        if hi <= lo:
            return
        pool.remove(b)
        pieces = []
        if lo > b.addr:
            pieces.append((b.addr, lo - b.addr, True))
        pieces.append((lo, hi - lo, False))
        if b.addr + b.size > hi:
            pieces.append((hi, b.addr + b.size - hi, True))
        prev, nxt = b.prev, b.next
        made: list[Block] = []
        for addr, sz, mapped in pieces:
            nb = Block(addr, sz, b.small, b.stream, b.segment, mapped=mapped)
            made.append(nb)
        for x, y in itertools.pairwise(made):
            x.next, y.prev = y, x
        made[0].prev, made[-1].next = prev, nxt
        if prev is not None:
            prev.next = made[0]
        if nxt is not None:
            nxt.prev = made[-1]
        self._unreserve(hi - lo, "segment_unmap", lo)
        for nb in made:
            if nb.mapped:
                pool.insert(nb)
            else:
                pool.unmapped.append(nb)
                for other in (nb.prev, nb.next):
                    self._merge(nb, other, pool)

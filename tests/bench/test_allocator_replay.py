"""The caching allocator's rules as `bench.allocator_replay` replays them."""

from __future__ import annotations

from bench.allocator_replay import MIN_BLOCK, CachingAllocator

MIB = 1 << 20


def test_segment_sizes_by_request():
    a = CachingAllocator()
    a.malloc(100)  # small: rounded to 512 B, a 2 MiB segment
    assert (a.allocated, a.reserved) == (MIN_BLOCK, 2 * MIB)
    a.malloc(12 * MIB + 1)  # 10 MiB and over: its own segment, rounded up to 2 MiB, split
    assert a.reserved == 2 * MIB + 14 * MIB and a.allocated == 12 * MIB + 2 * MIN_BLOCK
    a.malloc(3 * MIB)  # under 10 MiB: a 20 MiB segment, split
    assert a.reserved == 36 * MIB and a.segments == 3
    a.malloc(16 * MIB)  # best fit: the 20 MiB segment's 17 MiB rest, handed out whole
    assert a.segments == 3 and a.allocated == 2 * MIN_BLOCK + 12 * MIB + 3 * MIB + 17 * MIB


def test_best_fit_split_and_merge():
    a = CachingAllocator()
    big = a.malloc(64 * MIB)
    a.free(big)
    half = a.malloc(32 * MIB)  # splits the cached 64 MiB block
    other = a.malloc(32 * MIB)  # takes the remainder
    assert a.reserved == 64 * MIB and a.segments == 1
    a.free(half)
    a.free(other)  # merged back into one block
    assert a.malloc(64 * MIB).size == 64 * MIB and a.segments == 1


def test_a_large_remainder_of_one_mib_or_less_is_not_split_off():
    a = CachingAllocator()
    a.free(a.malloc(12 * MIB))
    block = a.malloc(11 * MIB)  # 1 MiB left: handed out whole
    assert block.size == 12 * MIB and a.allocated == 12 * MIB
    a.free(block)
    assert a.malloc(10 * MIB).size == 10 * MIB  # 2 MiB left: split
    assert a.peak_reserved == 12 * MIB

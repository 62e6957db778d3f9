"""BlockManager on tiny pools: exact block ids, ref counts, eviction order, nothing leaked."""
import pytest

from pagestream.engine.block_manager import BlockManager
from pagestream.engine.sampling_params import SamplingParams
from pagestream.engine.sequence import Sequence

_counter = iter(range(10**6))


def seq(tokens, name=None):
    n = next(_counter)
    return Sequence(
        seq_id=name or f"s{n}", request_id=name or f"r{n}", sample_index=0, token_ids=list(tokens),
        num_prompt_tokens=len(tokens), params=SamplingParams(), arrival_order=n,
    )


def test_allocates_from_the_head_of_the_free_list_and_frees_back():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10))
    assert bm.allocate_slots(a, 10)
    assert a.block_table == [0, 1, 2]
    assert [bm.blocks[i].ref_cnt for i in range(4)] == [1, 1, 1, 0]
    assert bm.num_free_blocks == 5
    bm.free(a)
    assert bm.num_free_blocks == 8
    assert all(b.ref_cnt == 0 for b in bm.blocks)


def test_refuses_without_changing_anything_when_short():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq(range(13))  # needs 4 blocks
    assert not bm.allocate_slots(a, 13)
    assert a.block_table == [] and bm.num_free_blocks == 3


def test_prefix_hit_shares_full_blocks_by_ref_count():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    hits, num_cached = bm.get_computed_blocks(b)
    assert hits == [0, 1] and num_cached == 8
    assert bm.allocate_slots(b, 2, hits)
    assert b.block_table == [0, 1, 3]  # the 8 hit tokens + 2 new ones
    assert b.num_computed_tokens == 0  # the scheduler owns the counts; it adds the hits
    assert [bm.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    bm.free(b)
    assert bm.num_free_blocks == 10


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(range(8))
    assert bm.allocate_slots(a, 8)
    b = seq(range(8))
    hits, num_cached = bm.get_computed_blocks(b)
    assert hits == [0] and num_cached == 4  # block 1 would leave nothing to compute


def test_freed_blocks_stay_hittable_until_evicted_lru_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5, 6])  # blocks 0,1,2 (all full)
    assert bm.allocate_slots(a, 6)
    bm.free(a)  # tail first: free order 3, 2, 1, 0
    assert list(bm._free) == [3, 2, 1, 0]
    # the prefix is still cached after free
    b = seq([1, 2, 3, 4, 9])
    hits, n = bm.get_computed_blocks(b)
    assert hits == [0, 1] and n == 4
    # allocation takes from the head: the never-used block 3, then block 2 (evicting [5, 6])
    c = seq([7, 7, 7, 7])
    assert bm.allocate_slots(c, 4)
    assert c.block_table == [3, 2]
    d = seq([1, 2, 3, 4, 5, 6, 0])
    hits, n = bm.get_computed_blocks(d)
    assert hits == [0, 1] and n == 4  # block 2 ([5, 6]) was evicted


def test_touching_a_cached_free_block_takes_it_off_the_free_list():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq([1, 2, 3])
    assert bm.allocate_slots(a, 3)
    bm.free(a)
    b = seq([1, 2, 3, 4, 5])
    hits, n = bm.get_computed_blocks(b)
    assert hits == [0]
    assert bm.allocate_slots(b, 3, hits)
    assert b.block_table == [0, 2, 1]
    assert bm.num_free_blocks == 0
    assert bm.blocks[0].ref_cnt == 1


def test_waste_counts_allocated_slots_without_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(5))
    assert bm.allocate_slots(a, 5)
    assert bm.waste([a]) == pytest.approx(3 / 8)


def test_prefix_cache_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = seq([1, 2, 3, 4, 5])
    assert bm.allocate_slots(a, 5)
    assert bm.get_computed_blocks(seq([1, 2, 3, 4, 5])) == ([], 0)

"""Paged KV cache bookkeeping: block ids, ref counts, free list, prefix cache.

Plain Python, no torch. Semantics follow vLLM v1's KVCacheManager/BlockPool:

* The pool has ``num_blocks`` blocks of ``block_size`` token slots.
* A *full* block's content is identified by a hash chained over every token
  before it, so two sequences with the same prefix map to the same blocks and
  share them by ref count (blocks are append-only: nothing is ever copied).
* A block whose ref count drops to zero goes to the tail of the free queue but
  keeps its hash: until it is handed out again it can still be hit. Allocation
  takes from the head, so the least recently freed block is evicted first.
  A finished sequence frees its blocks tail-first, so a shared prefix outlives
  the private suffix that followed it.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from pagestream.engine.sequence import Sequence

BlockHash = bytes


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


def hash_block_tokens(parent: BlockHash | None, tokens: list[int] | tuple[int, ...]) -> BlockHash:
    """Hash of a full block, chained on its parent's, 128 bits (collisions are not a concern)."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    """Owns every block id, ref count, the free queue and the prefix-cache table."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> None, in eviction order (head is evicted first)
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        # per sequence: hashes of its full blocks, computed once (seq_id -> list)
        self._seq_hashes: dict[str, list[BlockHash]] = {}
        # per sequence: how many of its leading blocks are registered in the cache
        self._seq_num_cached: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # ---- queries -------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, seq: Sequence) -> list[BlockHash]:
        """Hashes of seq's full blocks over its known tokens (extended incrementally)."""
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        num_full = seq.num_tokens // bs
        while len(hashes) < num_full:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    # ---- prefix cache ----------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Longest cached prefix of seq, as (block ids, tokens covered).

        At least one token is always left to compute, since the step needs the
        last position's logits. A request asking for prompt logprobs reads none (its first sample
        computes every prompt position it reports, as vLLM v1 skips the hits for it).
        """
        if not self.enable_prefix_caching or (seq.params.prompt_logprobs is not None and seq.sample_index == 0):
            return [], 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in self._block_hashes(seq)[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    # ---- allocation ------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        return self._num_blocks_to_allocate(seq, num_new_tokens, computed_blocks) <= len(self._free)

    def _num_blocks_to_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks) -> int:
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(seq.block_table) - len(computed_blocks)
        # Hit blocks with ref 0 sit in the free queue: touching them takes them out of it.
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_cnt == 0)
        return max(needed, 0) + revived

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Make seq's block table cover its computed tokens (plus the prefix hits
        in ``computed_blocks``) and ``num_new_tokens`` more. Returns False, changing
        nothing, when the pool is short of blocks. The hits' tokens become computed:
        the scheduler, which owns the counts, adds them after a success."""
        total = seq.num_computed_tokens + num_new_tokens
        if not computed_blocks and len(seq.block_table) * self.block_size >= total:
            # The common decode step: the token fits in a block seq already holds.
            if self.enable_prefix_caching and total // self.block_size > self._seq_num_cached.get(seq.seq_id, 0):
                self._cache_full_blocks(seq, total)
            return True
        if self._num_blocks_to_allocate(seq, num_new_tokens, computed_blocks) > len(self._free):
            return False
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1
            seq.block_table.append(block_id)
        total = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        while len(seq.block_table) < self.blocks_needed(total):
            seq.block_table.append(self._pop_free())
        if self.enable_prefix_caching:
            self._cache_full_blocks(seq, total)
        return True

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached content
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
        assert block.ref_cnt == 0
        block.ref_cnt = 1
        return block_id

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that ``num_tokens`` fills. The content is written in
        this step's forward pass, which stores every token's K/V before any
        attention reads, so a sequence hitting these blocks in the same step is safe."""
        hashes = self._block_hashes(seq)
        start = self._seq_num_cached.get(seq.seq_id, 0)
        end = min(num_tokens // self.block_size, len(hashes))
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                block.block_hash = hashes[i]
                self._cached.setdefault(hashes[i], block.block_id)
        if end > start:
            self._seq_num_cached[seq.seq_id] = end

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, tail first, and forget its table."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed twice"
            if block.ref_cnt == 0:
                self._free[block_id] = None
        seq.block_table = []
        self._seq_hashes.pop(seq.seq_id, None)
        self._seq_num_cached.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0:
                block.block_hash = None
        self._cached = {h: b for h, b in self._cached.items() if self.blocks[b].block_hash == h}

    def waste(self, seqs: list[Sequence]) -> float:
        """Fraction of allocated slots (of running sequences) that hold no token."""
        allocated = sum(len(s.block_table) for s in seqs) * self.block_size
        if not allocated:
            return 0.0
        used = sum(min(s.num_tokens, len(s.block_table) * self.block_size) for s in seqs)
        return 1.0 - used / allocated

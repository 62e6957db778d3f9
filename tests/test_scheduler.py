"""Scheduler on tiny pools: continuous batching, chunked prefill, preemption, priority."""
from pagestream.engine.block_manager import BlockManager
from pagestream.engine.sampling_params import SamplingParams
from pagestream.engine.scheduler import Scheduler
from pagestream.engine.sequence import Sequence, SequenceStatus


def make(num_blocks=16, block_size=4, max_num_seqs=4, budget=64, max_model_len=256, prefix=True):
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(bm, max_num_seqs, budget, max_model_len), bm


def seq(name, n_tokens, order, priority=0, start=0):
    return Sequence(seq_id=name, request_id=name, sample_index=0, token_ids=list(range(start, start + n_tokens)),
                    num_prompt_tokens=n_tokens, params=SamplingParams(), arrival_order=order, priority=priority)


def run_step(sched, sampled_token=7):
    out = sched.schedule()
    for s in sched.update_from_output(out):
        sched.append_token(s, sampled_token)
    return out


def test_prefill_then_decode_and_requests_join_between_steps():
    sched, bm = make()
    a = seq("a", 6, 0)
    sched.add(a)
    out = run_step(sched)
    assert out.num_scheduled_tokens == {a: 6}
    b = seq("b", 3, 1, start=100)
    sched.add(b)
    out = run_step(sched)
    assert out.num_scheduled_tokens == {a: 1, b: 3}  # decode of a mixed with prefill of b
    assert a.block_table == [0, 1] and b.block_table == [2]


def test_chunked_prefill_respects_the_token_budget():
    sched, bm = make(budget=5)
    a = seq("a", 12, 0)
    sched.add(a)
    assert run_step(sched).num_scheduled_tokens == {a: 5}
    assert run_step(sched).num_scheduled_tokens == {a: 5}
    assert a.num_output_tokens == 0
    assert run_step(sched).num_scheduled_tokens == {a: 2}
    assert a.num_output_tokens == 1  # the last chunk samples


def test_max_num_seqs_caps_the_running_batch():
    sched, _ = make(max_num_seqs=2)
    seqs = [seq(f"s{i}", 2, i, start=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = run_step(sched)
    assert set(out.num_scheduled_tokens) == {seqs[0], seqs[1]}
    assert seqs[2].status is SequenceStatus.WAITING


def test_preemption_frees_the_latest_and_it_recomputes_later():
    sched, bm = make(num_blocks=4, block_size=2, budget=64)
    a = seq("a", 3, 0, start=0)
    b = seq("b", 3, 1, start=50)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # a: 4 tokens known -> blocks [0,1]; b: [2,3]
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    run_step(sched)  # a decodes into its block 1 (4 tokens), b likewise
    out = run_step(sched)  # a needs a 3rd block: b (latest) is preempted
    assert out.preempted == [b]
    assert out.num_scheduled_tokens == {a: 1}
    # b freed tail first (free list [3, 2]), so a's new block is b's last one
    assert a.block_table == [0, 1, 3]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert sched.num_preemptions == 1
    sched.finish(a, "stop")
    known = b.num_tokens  # 3 prompt + 2 generated
    out = run_step(sched)
    # block 2 ([50, 51]) survived in the prefix cache; block 3 was evicted
    assert b.num_cached_tokens == 2
    assert out.num_scheduled_tokens[b] == known - 2
    sched.finish(b, "stop")
    assert bm.num_free_blocks == 4


def test_priority_orders_admission_and_preemption():
    sched, _ = make(max_num_seqs=1)
    low = seq("low", 2, 0, priority=5)
    high = seq("high", 2, 1, priority=0)
    sched.add(low)
    sched.add(high)
    out = run_step(sched)
    assert list(out.num_scheduled_tokens) == [high]


def test_every_block_returns_when_all_requests_end_or_abort():
    sched, bm = make(num_blocks=12, block_size=2, budget=7)
    seqs = [seq(f"s{i}", 5 + i, i, start=20 * i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    for _ in range(5):
        run_step(sched)
    sched.finish(seqs[0], "stop")
    sched.finish(seqs[3], "abort")  # possibly still waiting or mid-prefill
    for _ in range(3):
        run_step(sched)
    sched.finish(seqs[1], "length")
    sched.finish(seqs[2], "abort")
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == 12
    assert all(b.ref_cnt == 0 for b in bm.blocks)

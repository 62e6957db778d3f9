"""``engine.output_processor.OutputProcessor`` on its own: core outputs built by hand (the
``core_messages`` types an engine core sends) through SmolLM2's real tokenizer, and the
``RequestOutput``s a caller would see: stop strings cut across token boundaries, final vs delta
outputs, n samples, aborts, logprobs merged over steps, and a request that failed in the core."""
from __future__ import annotations

import pytest

from pagestream.engine.core_messages import EngineCoreError, ErrorType, RequestDelta, SampleDelta, StopSample, TokenBatch
from pagestream.engine.output_processor import OutputProcessor, core_params
from pagestream.engine.sampling_params import SamplingParams
from pagestream.engine.tokenizer import load_tokenizer

TEXT = " The quick brown fox jumps over the lazy dog"
STOP = "k bro"  # spans " quick" and " brown"


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def ids(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT
    assert not any(STOP in tok.decode([t]) for t in ids)  # the stop string lies across tokens
    return ids


def _proc(tok, params: SamplingParams, rid: int = 0, name: str = "req", resume: list[int] | None = None) -> OutputProcessor:
    proc = OutputProcessor(tok)
    proc.add_request(rid, name, "a prompt", [1, 2, 3], resume or [], params)
    return proc


def _one_by_one(proc: OutputProcessor, rid: int, token_ids: list[int]):
    """Each token in its own core step (a TokenBatch, as the core sends single-sample decode tokens)."""
    steps = []
    for t in token_ids:
        steps.append(proc.process([TokenBatch([rid], [t])]))
    return steps


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_tokens_cuts_the_text_and_ends_the_request(tok, ids, include):
    proc = _proc(tok, SamplingParams(stop=[STOP], include_stop_str_in_output=include))
    steps = _one_by_one(proc, 0, ids)
    outs = [o for s in steps for o in s.outputs]
    text = "".join(c.text for o in outs for c in o.outputs)
    want = TEXT[:TEXT.index(STOP) + (len(STOP) if include else 0)]
    assert text == want
    # no part of the stop string was shown before it was known to be one
    for k in range(1, len(outs)):
        shown = "".join(c.text for o in outs[:k] for c in o.outputs)
        assert want.startswith(shown)
    last = outs[-1]
    assert last.finished and sum(o.finished for o in outs) == 1
    assert (last.outputs[0].finish_reason, last.outputs[0].stop_reason) == ("stop", STOP)
    # token ids end with the token that completed the stop string; later ones are dropped
    got_ids = [t for o in outs for c in o.outputs for t in c.token_ids]
    assert got_ids == ids[:len(got_ids)] and STOP in tok.decode(got_ids) and STOP not in tok.decode(got_ids[:-1])
    # the core still runs it: it is told to free it, once; the request is forgotten
    assert [a for s in steps for a in s.aborts] == [0]
    assert len(proc) == 0 and proc.num_seqs == 0 and 0 not in proc


def test_the_core_runs_a_request_without_stop_strings_and_in_delta_outputs():
    p = SamplingParams(stop=["x"], output_kind="final", max_tokens=7)
    cp = core_params(p)
    assert cp.stop_strs == [] and cp.output_kind == "delta" and cp.max_tokens == 7
    assert p.stop_strs == ["x"] and p.output_kind == "final"  # the caller's params are unchanged
    plain = SamplingParams()
    assert core_params(plain) is plain


def test_delta_outputs_every_step_final_outputs_once_whole(tok, ids):
    head, tail = ids[:4], ids[4:]
    for kind in ("delta", "final"):
        proc = _proc(tok, SamplingParams(output_kind=kind))
        outs = [o for s in _one_by_one(proc, 0, head) for o in s.outputs]
        end = proc.process([RequestDelta(0, True, None, {"ttft_s": 0.5}, [SampleDelta(0, tail, None, None, "length", None)])])
        outs += end.outputs
        if kind == "delta":
            assert len(outs) == len(head) + 1
            assert [c.first_token_index for o in outs for c in o.outputs] == list(range(len(head) + 1))
            assert "".join(o.outputs[0].text for o in outs) == TEXT
        else:
            assert len(outs) == 1
            (c,) = outs[0].outputs
            assert c.text == TEXT and c.token_ids == ids and c.first_token_index == 0
        last = outs[-1]
        assert last.finished and last.outputs[0].finish_reason == "length"
        assert last.metrics == {"ttft_s": 0.5} and last.prompt == "a prompt" and last.prompt_token_ids == [1, 2, 3]
        assert end.aborts == [] and end.stop_samples == [] and len(proc) == 0


def test_resumed_tokens_count_as_already_shown(tok, ids):
    proc = _proc(tok, SamplingParams(), resume=ids[:3])
    out = proc.process([RequestDelta(0, True, None, None, [SampleDelta(0, ids[3:], None, None, "length", None)])]).outputs[0]
    assert out.outputs[0].text == tok.decode(ids)[len(tok.decode(ids[:3])):]
    assert out.outputs[0].first_token_index == 3


def test_n_samples_finish_only_when_all_have_and_a_stopped_sample_is_told_to_the_core(tok, ids):
    proc = _proc(tok, SamplingParams(n=2, stop=[STOP]), rid=5)
    assert proc.num_seqs == 2
    cut = next(k for k in range(len(ids)) if STOP in tok.decode(ids[:k + 1])) + 1
    other = ids[-4:]  # " over the lazy dog": sample 1 never meets the stop string
    # sample 0 reaches the stop string here; sample 1 goes on
    s = proc.process([RequestDelta(5, False, None, None, [SampleDelta(0, ids[:cut], None, None, None, None),
                                                         SampleDelta(1, other[:2], None, None, None, None)])])
    (out,) = s.outputs
    assert not out.finished
    assert out.outputs[0].finish_reason == "stop" and out.outputs[1].finish_reason is None
    assert s.stop_samples == [StopSample(5, 0, STOP)] and s.aborts == []
    # tokens the core sampled for sample 0 before it heard are dropped; it is not told twice
    s = proc.process([RequestDelta(5, False, None, None, [SampleDelta(0, ids[cut:], None, None, None, None),
                                                         SampleDelta(1, other[2:3], None, None, None, None)])])
    (out,) = s.outputs
    assert not out.finished and out.outputs[0].token_ids == [] and out.outputs[0].text == ""
    assert out.outputs[1].token_ids == other[2:3] and s.stop_samples == []
    assert len(proc) == 1 and proc.num_seqs == 2
    # sample 1 ends in the core: now the request is finished
    s = proc.process([RequestDelta(5, True, None, None, [SampleDelta(1, other[3:], None, None, "length", None)])])
    (out,) = s.outputs
    assert out.finished and [c.finish_reason for c in out.outputs] == ["stop", "length"]
    assert out.outputs[1].token_ids == other[3:]
    assert len(proc) == 0 and proc.num_seqs == 0


def test_abort_ends_the_running_samples_and_shows_held_back_text(tok, ids):
    proc = _proc(tok, SamplingParams(n=2, stop=["never appears in it"]), rid=1)
    first = proc.process([RequestDelta(1, False, None, None, [SampleDelta(0, ids[:3], None, None, None, None),
                                                             SampleDelta(1, ids[:2], None, None, "length", None)])]).outputs[0]
    out = proc.abort(1)
    assert out.finished and out.request_id == "req"
    assert [c.finish_reason for c in out.outputs] == ["abort", "length"]
    # text held back as a possible start of the stop string is shown at the end
    assert first.outputs[0].text + out.outputs[0].text == tok.decode(ids[:3])
    assert len(proc) == 0 and proc.num_seqs == 0
    # the core's later outputs for it are ignored; a second abort has nothing to say
    assert proc.process([TokenBatch([1], [ids[3]])]).outputs == []
    assert proc.abort(1) is None


def test_abort_of_a_final_request_gives_its_whole_output(tok, ids):
    proc = _proc(tok, SamplingParams(output_kind="final"))
    assert proc.process([TokenBatch([0], [ids[0]]), TokenBatch([0], [ids[1]])]).outputs == []
    out = proc.abort(0)
    assert out.finished and out.outputs[0].token_ids == ids[:2] and out.outputs[0].text == tok.decode(ids[:2])
    assert out.outputs[0].finish_reason == "abort"


def _lp(t: int, v: float) -> dict[int, float]:
    return {t: v, t + 1: v - 1.0}


def test_logprobs_merge_over_steps(tok, ids):
    steps = [(ids[0:2], [-0.1, -0.2]), (ids[2:3], [-0.3]), (ids[3:5], [-0.4, -0.5])]

    def delta(k, last=False):
        toks, vals = steps[k]
        cumulative = sum(sum(s[1]) for s in steps[:k + 1])
        return RequestDelta(0, last, None, None, [SampleDelta(0, toks, cumulative, [_lp(t, v) for t, v in zip(toks, vals)],
                                                              "length" if last else None, None)])

    want = [_lp(t, v) for toks, vals in steps for t, v in zip(toks, vals)]
    total = sum(sum(vals) for _, vals in steps)
    # final: one output with every token's logprobs, the last cumulative logprob
    proc = _proc(tok, SamplingParams(output_kind="final", logprobs=1))
    assert proc.process([delta(0)]).outputs == [] and proc.process([delta(1)]).outputs == []
    (out,) = proc.process([delta(2, last=True)]).outputs
    assert out.outputs[0].logprobs == want and out.outputs[0].token_ids == ids[:5]
    assert out.outputs[0].cumulative_logprob == pytest.approx(total)
    # delta: two core steps read at once make one output, their logprobs in order
    proc = _proc(tok, SamplingParams(logprobs=1))
    (a,) = proc.process([delta(0), delta(1)]).outputs
    assert a.outputs[0].logprobs == want[:3] and a.outputs[0].token_ids == ids[:3]
    (b,) = proc.process([delta(2, last=True)]).outputs
    assert b.outputs[0].logprobs == want[3:] and b.outputs[0].first_token_index == 3 and b.finished
    # not asked for: none given, whatever the core sent
    proc = _proc(tok, SamplingParams())
    (c,) = proc.process([delta(0)]).outputs
    assert c.outputs[0].logprobs is None and c.outputs[0].cumulative_logprob is None


def test_a_request_error_ends_that_request_only(tok, ids):
    proc = OutputProcessor(tok)
    proc.add_request(0, "bad", None, [1], [], SamplingParams(stop=[STOP]))
    proc.add_request(1, "good", None, [1], [], SamplingParams())
    err = EngineCoreError(ErrorType.REQUEST, "ValueError: grammar failed")
    s = proc.process([RequestDelta(0, True, err, None, [SampleDelta(0, [], None, None, None, None)]), TokenBatch([1], [ids[0]])])
    by = {o.request_id: o for o in s.outputs}
    assert by["bad"].finished and by["bad"].error == "ValueError: grammar failed"
    assert not by["good"].finished and by["good"].error is None
    assert s.aborts == [] and 0 not in proc and 1 in proc and proc.num_seqs == 1


def test_a_final_output_cut_at_a_stop_string_comes_once_whole(tok, ids):
    proc = _proc(tok, SamplingParams(stop=[STOP], output_kind="final"), resume=ids[:1])
    steps = _one_by_one(proc, 0, ids[1:])
    outs = [o for s in steps for o in s.outputs]
    assert len(outs) == 1 and outs[0].finished
    (c,) = outs[0].outputs
    # the resumed token's text (" The", 4 characters) was held back as a possible start of the stop string
    # (5 characters) by the worker that made it, so it was never shown: it is shown here
    assert c.text == TEXT[:TEXT.index(STOP)]
    assert (c.finish_reason, c.stop_reason) == ("stop", STOP)
    # token ids made here (after the resumed one), up to the one that completed the stop string
    assert c.first_token_index == 1 and c.token_ids == ids[1:1 + len(c.token_ids)]
    assert STOP in tok.decode(ids[:1] + c.token_ids) and STOP not in tok.decode(ids[:1] + c.token_ids[:-1])
    assert [a for s in steps for a in s.aborts] == [0] and len(proc) == 0


def test_time_to_first_token_is_measured_here_when_the_core_sends_none(tok, ids):
    proc = _proc(tok, SamplingParams())
    proc.process([TokenBatch([0], [ids[0]])])
    (out,) = proc.process([RequestDelta(0, True, None, None, [SampleDelta(0, ids[1:3], None, None, "length", None)])]).outputs
    assert set(out.metrics) == {"arrival_time", "time_to_first_token"} and out.metrics["time_to_first_token"] >= 0
    # aborted before any token: nothing to say
    proc = _proc(tok, SamplingParams())
    assert proc.abort(0).metrics == {}

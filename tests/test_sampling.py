"""Sampling a user would notice: seeds reproduce in any batch, stop strings never leak,
n samples, min/max tokens, logprobs, penalties."""
import pytest

from pagestream.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, device="cpu", max_num_seqs=32)


PROMPT = "Once upon a time in a quiet village"
OTHERS = [f"filler prompt number {i} about {'boats ' * (i % 5)}" for i in range(15)]


def test_seeded_sampling_is_the_same_alone_and_mixed_with_15_others(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    mixed = llm.generate(OTHERS[:7] + [PROMPT] + OTHERS[7:], [unseeded] * 7 + [params] + [unseeded] * 8, use_tqdm=False)
    assert mixed[7].outputs[0].token_ids == alone
    again = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=99, max_tokens=24, ignore_eos=True)
    assert llm.generate([PROMPT], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_resume_from_published_tokens_continues_the_seeded_run(llm):
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    full = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    engine = llm.llm_engine
    engine.add_request("resumed", prompt=PROMPT, params=params, resume_token_ids=full.token_ids[:9])
    tokens, text = [], ""
    first_index = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            first_index = c.first_token_index if first_index is None else first_index
            tokens += c.token_ids
            text += c.text
    assert first_index == 9
    assert full.token_ids[:9] + tokens == full.token_ids
    # the resumed text continues exactly after the text of the 9 published tokens
    published = engine.tokenizer.decode(full.token_ids[:9], skip_special_tokens=True).rstrip("\ufffd")
    assert full.text == published + text


def test_stop_string_is_never_emitted_even_in_part(llm):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    text = base.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 5]
    assert len(stop.strip()) >= 3
    engine = llm.llm_engine
    engine.add_request("stopper", prompt=PROMPT, params=SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True))
    deltas = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].text)
            final = out.outputs[0]
    streamed = "".join(deltas)
    assert streamed == text[: text.index(stop)]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    for i in range(1, len(deltas) + 1):  # no prefix of the stream ever showed the stop string's start
        assert stop not in "".join(deltas[:i])


def test_n_samples_share_the_prompt_and_differ(llm):
    # a prompt of several whole KV blocks, new to this engine: the three later samples read the first one's blocks
    # (counted from before this request: the module's engine may have served other tests, or none, before it)
    prompt = " ".join([PROMPT, "and a river ran past the mill where the miller's daughter sang"] * 4)
    before = llm.llm_engine.stats().prefix_cache_hits
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.llm_engine.stats().prefix_cache_hits - before >= 3 * 16  # each later sample found at least a block


def test_min_tokens_holds_off_eos_and_stop_token_ids_end_the_output(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop_tok = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_tok)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy.token_ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    late = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok], min_tokens=first + 2),
                        use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) > first + 1


def test_logprobs_are_returned_per_token_and_sum_to_the_cumulative(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and 3 <= len(lp) <= 4
        assert lp[tok] == max(lp.values())  # greedy picks the top logprob
        assert all(v <= 0 for v in lp.values())
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs)), rel=1e-5)


def test_repetition_penalty_changes_a_repetitive_greedy_output(llm):
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    pen = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=5.0,
                                                frequency_penalty=1.5), use_tqdm=False)[0].outputs[0]
    assert len(set(pen.token_ids)) >= len(set(plain.token_ids))
    assert pen.token_ids != plain.token_ids


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    k1 = llm.generate([PROMPT], SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert k1.token_ids == greedy.token_ids


def test_streamed_text_equals_a_plain_decode_even_when_the_output_ends_mid_character(smollm2_dir):
    # what a subscriber joins from the deltas, and the final text, are the tokenizer's own decode of
    # the tokens: also when the last tokens are bytes of a character the output never finished
    import random

    from transformers import AutoTokenizer

    from pagestream.engine.detokenizer import IncrementalDetokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    lead = tok.convert_tokens_to_ids("â")  # the byte 0xE2, which starts a 3-byte character
    rng = random.Random(0)
    cut = 0
    for i in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        if i % 2:
            ids += [lead] * rng.randrange(1, 3)
        detok = IncrementalDetokenizer(tok, SamplingParams(max_tokens=64, output_kind="delta"))
        streamed = ""
        for t in ids:
            detok.add_token(t)
            streamed += detok.take_delta(False)
        streamed += detok.take_delta(True)
        assert streamed == tok.decode(ids, skip_special_tokens=True), ids
        cut += streamed.endswith("\ufffd")
    assert cut >= 150  # the unfinished endings were exercised


def test_final_texts_are_each_a_plain_decode_with_or_without_special_tokens(smollm2_dir):
    # LLM.generate's texts (output_kind "final") are decoded once at the end, through the tokenizer's
    # own _decode: each must be exactly what tokenizer.decode gives
    import random

    from transformers import AutoTokenizer

    from pagestream.engine.detokenizer import IncrementalDetokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    rng = random.Random(1)
    for i in range(60):
        skip = bool(i % 2)
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        ids[rng.randrange(len(ids))] = tok.eos_token_id  # a special token, kept or skipped
        d = IncrementalDetokenizer(tok, SamplingParams(max_tokens=64, skip_special_tokens=skip, output_kind="final"))
        for t in ids:
            d.add_token(t)
        assert d.take_delta(False) == ""  # nothing before the end
        assert d.take_delta(True) == tok.decode(ids, skip_special_tokens=skip), ids

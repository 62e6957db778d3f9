"""Acceptance 1, 2 and 6 of issue 10: ``pagestream serve --model <SmolLM2 dir>`` answers the openai client,
its text and logprobs equal ``LLM.generate`` / ``LLM.chat`` with the same seed, and a client that goes
away mid-stream has its KV blocks back in the free pool within a step (SmolLM2-135M on the CPU)."""
from __future__ import annotations

import statistics
import threading
import time
import uuid

import httpx
import openai
import pytest
import redis
from openai.types.completion_choice import Logprobs
from prometheus_client.parser import text_string_to_metric_families

from pagestream.producer import JobResult
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.wire import decode_out_entry
from gateway_helpers import ServeProc
from private_redis import free_port
from queue_helpers import wait_for
from test_gateway import DB_URL, _lane_heads

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def metrics_port() -> int:
    """Where the served worker's Prometheus metrics are (``serve`` passes the env to its worker)."""
    return free_port()


@pytest.fixture(scope="module")
def served(smollm2_dir, tmp_path_factory, metrics_port):
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    # vLLM's opt-in surface on too (request chat templates, cached_tokens, /tokenizer_info): one stack checks it all
    serve = ServeProc(smollm2_dir, "--served-model-name", "smollm2", "--max-num-seqs", "4", "--trust-request-chat-template",
                      "--enable-prompt-tokens-details", "--enable-tokenizer-info-endpoint",
                      log_dir=tmp_path_factory.mktemp("serve"), env={"PAGESTREAM_METRICS_PORT": str(metrics_port)})
    try:
        serve.wait_ready()
        yield openai.OpenAI(base_url=serve.base_url, api_key="unused", max_retries=0, timeout=600)
    finally:
        serve.stop()
        r.flushdb()


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    from pagestream.engine import LLM

    return LLM(smollm2_dir, device="cpu", max_num_seqs=4, seed=0)


def test_serve_answers_the_openai_client_with_the_engines_text(served, llm):
    from pagestream.engine import SamplingParams

    assert [m.id for m in served.models.list()] == ["smollm2"]

    params = SamplingParams(temperature=0.8, seed=7, max_tokens=12)
    want = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].text
    got = served.completions.create(model="smollm2", prompt="The capital of France is", temperature=0.8, seed=7, max_tokens=12)
    assert got.choices[0].text == want and got.usage.completion_tokens == 12

    msgs = [{"role": "user", "content": "Name a colour."}]
    want_chat = llm.chat(msgs, SamplingParams(temperature=0.7, seed=3, max_tokens=10), use_tqdm=False)[0].outputs[0].text
    chunks = served.chat.completions.create(model="smollm2", messages=msgs, temperature=0.7, seed=3, max_tokens=10, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want_chat

    two = served.chat.completions.create(model="smollm2", messages=msgs, n=2, temperature=1.0, seed=5, max_tokens=8)
    want_two = llm.chat(msgs, SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8), use_tqdm=False)[0].outputs
    assert [c.message.content for c in two.choices] == [o.text for o in want_two]


def _top(d: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(d.items(), key=lambda tv: -tv[1])[:k]


def test_logprobs_through_the_queue_equal_the_engines(served, llm):
    from pagestream.engine import SamplingParams

    tok = llm.get_tokenizer()
    k = 3
    prompt = "The capital of France is"
    # greedy /v1/completions, whole and streamed
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=k), use_tqdm=False)[0].outputs[0]
    kw = dict(model="smollm2", prompt=prompt, max_tokens=8, temperature=0, logprobs=k)
    done = openai.types.Completion.model_validate(served.completions.with_raw_response.create(**kw).http_response.json())
    lp = done.choices[0].logprobs
    assert done.choices[0].text == ref.text and lp.tokens == [tok.decode([t]) for t in ref.token_ids]
    assert lp.token_logprobs == pytest.approx([d[t] for t, d in zip(ref.token_ids, ref.logprobs)], abs=1e-5)
    for token, tops, t, d in zip(lp.tokens, lp.top_logprobs, ref.token_ids, ref.logprobs, strict=True):
        assert max(tops, key=tops.get) == token  # greedy: the most likely token is the one chosen
        assert len(tops) == len({tok.decode([i]) for i, _ in _top(d, k)}) and all(v <= 0 for v in tops.values())
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    parts = [Logprobs.model_validate(ch.choices[0].logprobs.model_dump())
             for ch in served.completions.create(**kw, stream=True) if ch.choices and ch.choices[0].logprobs]
    assert [x for p in parts for x in p.tokens] == lp.tokens and [x for p in parts for x in p.text_offset] == lp.text_offset

    # seeded sampling in chat, streamed and whole: the sampled tokens' logprobs and the top k are the engine's
    msgs = [{"role": "user", "content": "Name a colour."}]
    ref = llm.chat(msgs, SamplingParams(temperature=0.7, seed=3, max_tokens=10, logprobs=k), use_tqdm=False)[0].outputs[0]
    kw = dict(model="smollm2", messages=msgs, temperature=0.7, seed=3, max_tokens=10, logprobs=True, top_logprobs=k)
    chunks = [openai.types.chat.ChatCompletionChunk.model_validate(ch.model_dump())
              for ch in served.chat.completions.create(**kw, stream=True)]
    content = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    raw = served.chat.completions.with_raw_response.create(**kw).http_response.json()
    whole = openai.types.chat.ChatCompletion.model_validate(raw)
    assert whole.choices[0].message.content == ref.text
    # the same tokens and top tokens streamed and whole; the floats to 1e-4 (the second request's prompt is a prefix-cache
    # hit, and a cached prefill sums in another order: up to 1.3e-5 apart in a low top-logprob, one torch thread each)
    def shape(ts):
        return [(t.token, t.bytes, [(a.token, a.bytes) for a in t.top_logprobs]) for t in ts]

    def floats(ts):
        return [x for t in ts for x in (t.logprob, *(a.logprob for a in t.top_logprobs))]

    assert shape(content) == shape(whole.choices[0].logprobs.content)
    assert floats(content) == pytest.approx(floats(whole.choices[0].logprobs.content), abs=1e-4)
    assert [t.token for t in content] == [tok.decode([i]) for i in ref.token_ids]
    for t, i, d in zip(content, ref.token_ids, ref.logprobs, strict=True):
        assert t.logprob == pytest.approx(d[i], abs=1e-5) and t.logprob <= 0 and t.bytes == list(t.token.encode())
        assert len(t.top_logprobs) == k
        assert [a.token for a in t.top_logprobs] == [tok.decode([j]) for j, _ in _top(d, k)]
        assert [a.logprob for a in t.top_logprobs] == pytest.approx([v for _, v in _top(d, k)], abs=1e-5)


def _scrape(port: int) -> dict[str, float]:
    # only the two series read here: a scrape of everything (histograms) takes the worker's GIL for longer
    names = {"name[]": ["pagestream_kv_free_blocks", "pagestream_engine_steps_total"]}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", params=names, timeout=5).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "pagestream_kv_free_blocks":
                out["free"] = smp.value
            elif smp.name == "pagestream_engine_steps_total":
                out["steps"] = smp.value
    return out


def result_of_job(r: redis.Redis, job_id: str) -> JobResult:
    return JobResult.model_validate_json(r.hget(keys.job_hash(job_id), "result"))


def test_a_disconnecting_client_frees_its_kv_blocks_within_a_step(served, metrics_port):
    """Acceptance 2: the client goes away mid-stream; its job's KV blocks are back in the worker's free
    pool (``pagestream_kv_free_blocks``), and the job ran at most the one step that was under way when
    the cancel came (its tokens after the gateway sent the cancel).

    The time from the client's close to the blocks being free is printed (BENCHMARKS.md)."""
    r = redis.Redis.from_url(DB_URL)
    wait_for(lambda: "free" in _scrape(metrics_port), 30, "the worker's metrics")
    idle = _scrape(metrics_port)["free"]
    figures = []
    for attempt in range(5):
        stream = served.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": f"Tell a very long story, number {attempt}."}],
            max_tokens=1000, seed=attempt, stream=True, extra_body={"ignore_eos": True})
        it = iter(stream)
        first = [next(it) for _ in range(4)]  # the role chunk and a few tokens: the job runs and holds blocks
        job_id = first[0].id.split("-", 1)[1]
        running = _scrape(metrics_port)
        running_at = time.time()
        assert running["free"] < idle

        samples: list[tuple[float, float, float]] = []  # (unix time, free blocks, engine steps)
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                m = _scrape(metrics_port)
                samples.append((time.time(), m["free"], m["steps"]))
                if m["free"] == idle:
                    return
                time.sleep(0.005)  # a scrape takes the worker's GIL: leave the loop room to step

        sampler = threading.Thread(target=sample)
        sampler.start()
        time.sleep(0.3)  # readings of the job still running: a few steps, to say how long one takes
        closed_at = time.time()
        stream.close()  # the client goes away
        sampler.join(30)
        stop.set()
        assert samples[-1][1] == idle, "the job's blocks never came back"
        freed_at = samples[-1][0]
        wait_for(lambda: r.hget(keys.job_hash(job_id), "status") == b"cancelled", 30, "the job to end cancelled")
        # When the gateway sent the cancel: the id of its entry in the cancel stream (the server's ms clock).
        cancel_ms = next(int(eid.split(b"-")[0]) for eid, f in r.xrange(keys.cancel_stream()) if f[b"job_id"] == job_id.encode())
        # The job's own steps are its tokens (one per decode step, the only job running): those published before
        # the cancel was sent (the publisher writes within ~20 ms of a step) against all it made (its result).
        made_before = sum(len(ev.token_ids) for eid, f in r.xrange(keys.out_stream(job_id))
                          if int(eid.split(b"-")[0]) < cancel_ms and not isinstance(ev := decode_out_entry(job_id, f), str))
        steps_after_cancel = result_of_job(r, job_id).completion_tokens - made_before
        # The loop reads cancels before every step: the step running when the cancel lands may finish, then the
        # job is aborted (its blocks freed); one more for a token made just before the cancel but written after.
        assert steps_after_cancel <= 2, (steps_after_cancel, made_before)
        held = [s for s in samples if s[1] < idle]  # readings while the job still held its blocks
        steps_run = held[-1][2] - running["steps"] if held else 0
        step_ms = (held[-1][0] - running_at) * 1000 / steps_run if steps_run > 0 else None
        figures.append(((freed_at - closed_at) * 1000, (freed_at - cancel_ms / 1000) * 1000, steps_after_cancel, step_ms))
    close_ms = [f[0] for f in figures]
    print(f"\ndisconnect -> blocks free: median {statistics.median(close_ms):.0f} ms, max {max(close_ms):.0f} ms; "
          f"cancel sent -> free: median {statistics.median(f[1] for f in figures):.0f} ms; "
          f"job steps after the cancel was sent: {[f[2] for f in figures]}; "
          f"decode step while the job ran: median {statistics.median([f[3] for f in figures if f[3] is not None] or [0]):.0f} ms")


def test_vllm_surface_on_smollm2_prompt_lists_token_ids_and_vocabulary_checks(served, llm):
    """Issue 24 on the real engine: a list of prompts answers each as the engine does alone, the prompt's token ids
    come back from the worker's tokenizer, and an id past SmolLM2's vocabulary is a 400 before any job."""
    from pagestream.engine import SamplingParams

    prompts = ["The capital of France is", "One, two, three,"]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    want = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    got = served.completions.create(model="smollm2", prompt=prompts, temperature=0.0, max_tokens=6,
                                    extra_body={"return_token_ids": True})
    assert [c.text for c in got.choices] == want
    ids = [c.model_dump()["prompt_token_ids"] for c in got.choices]
    assert ids == [llm.get_tokenizer().encode(p) for p in prompts]
    assert got.usage.prompt_tokens == sum(len(i) for i in ids)

    vocab = llm.get_tokenizer().vocab_size if hasattr(llm.get_tokenizer(), "vocab_size") else 49152
    with pytest.raises(openai.BadRequestError) as info:
        served.completions.create(model="smollm2", prompt=[[1, 2, vocab + 10]], max_tokens=2)
    assert "out of vocabulary" in info.value.body["message"]

    any_role = served.chat.completions.create(model="smollm2", max_tokens=4, temperature=0.0,
                                              messages=[{"role": "narrator", "content": "Once upon a time"},
                                                        {"role": "user", "content": "Go on."}])
    assert any_role.choices[0].message.content


def test_a_streamed_echo_with_logprobs_on_smollm2_equals_the_engines_prompt_logprobs(served, llm):
    """Issue 24: vLLM streams ``echo`` with ``logprobs``; the prompt's tokens and logprobs lead each choice's first
    chunk (scored by the worker in prefill), they equal the engine's own ``prompt_logprobs``, and the stream adds
    up to the answer not streamed (a text prompt, and a token-id prompt as lm-evaluation-harness sends one)."""
    from pagestream.engine import SamplingParams

    tok = llm.get_tokenizer()
    text = "The capital of France is"
    ids = tok.encode(text)
    want = llm.generate([text], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    for prompt, max_tokens in ((text, 3), (ids, 0)):
        kw = dict(model="smollm2", prompt=prompt, max_tokens=max_tokens, temperature=0.0, echo=True, logprobs=1)
        whole = served.completions.create(**kw).choices[0]
        chunks = [c for c in served.completions.create(stream=True, **kw) if c.choices]
        first = chunks[0].choices[0]
        assert first.text.startswith(text) and first.logprobs.tokens[:len(ids)] == [tok.decode([i]) for i in ids]
        assert first.logprobs.token_logprobs[0] is None
        for j in range(1, len(ids)):
            assert first.logprobs.token_logprobs[j] == pytest.approx(want.prompt_logprobs[j][ids[j]], abs=1e-4)
        assert "".join(c.choices[0].text for c in chunks) == whole.text
        assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == whole.logprobs.tokens
        assert [t for c in chunks for t in c.choices[0].logprobs.token_logprobs] == whole.logprobs.token_logprobs
        assert [t for c in chunks for t in c.choices[0].logprobs.text_offset] == whole.logprobs.text_offset
        assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "length"
    assert whole.text == text  # max_tokens=0: the prompt alone


def test_logit_bias_and_allowed_token_ids_steer_the_tokens_as_in_the_engine(served, llm):
    """OpenAI's logit_bias and vLLM's allowed_token_ids through the queue: the same tokens as ``LLM.generate``
    with the same params, and the steering a user asked for (+100 on a token makes greedy pick it every time;
    only the allowed tokens are ever sampled, also at temperature 1)."""
    from pagestream.engine import SamplingParams

    prompt = "The capital of France is"
    forced = llm.get_tokenizer().encode(" blue")[0]
    got = served.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=5,
                                    logit_bias={str(forced): 100}, extra_body={"return_token_ids": True})
    assert got.choices[0].model_dump()["token_ids"] == [forced] * 5
    plain = served.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=5)
    first = llm.get_tokenizer().encode(plain.choices[0].text)[0]
    banned = served.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=5,
                                       logit_bias={str(first): -100}, extra_body={"return_token_ids": True})
    assert banned.choices[0].model_dump()["token_ids"][0] != first
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logit_bias={first: -100}),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert banned.choices[0].model_dump()["token_ids"] == list(want)

    allowed = [llm.get_tokenizer().encode(w)[0] for w in (" yes", " no", " maybe")]
    msgs = [{"role": "user", "content": "Is the sky green?"}]
    chat = served.chat.completions.create(model="smollm2", messages=msgs, temperature=1.0, seed=11, max_tokens=8,
                                          extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    ids = chat.choices[0].model_dump()["token_ids"]
    assert ids and set(ids) <= set(allowed), ids
    want_chat = llm.chat(msgs, SamplingParams(temperature=1.0, seed=11, max_tokens=8, allowed_token_ids=allowed),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert ids == list(want_chat)


def test_truncate_prompt_tokens_on_smollm2_keeps_the_side_asked_for_after_the_workers_tokenizer(served, llm):
    """Issue 24: vLLM's ``truncate_prompt_tokens`` on a text prompt and on a chat (cut after its template): the
    worker keeps the last k tokens (``truncation_side="right"``: the first k), ``usage.prompt_tokens`` is k,
    ``return_token_ids`` and ``echo`` show the kept tokens, and the completion is the kept prompt's own; -1 keeps a
    prompt shorter than the context whole, and k past the context is vLLM's 400 before anything runs."""
    tok = llm.get_tokenizer()
    text = "The quick brown fox jumps over the lazy dog and then the capital of France is"
    ids = tok.encode(text)
    assert len(ids) > 10
    for side, kept in (("left", ids[-6:]), ("right", ids[:6])):
        cut = {"truncate_prompt_tokens": 6, "truncation_side": side}
        got = served.completions.create(model="smollm2", prompt=text, max_tokens=4, temperature=0.0, echo=True,
                                        extra_body={**cut, "return_token_ids": True})
        choice = got.choices[0].model_dump()
        assert got.usage.prompt_tokens == 6 and choice["prompt_token_ids"] == kept
        alone = served.completions.create(model="smollm2", prompt=kept, max_tokens=4, temperature=0.0)
        assert choice["text"] == alone.choices[0].text  # vLLM's echo with return_token_ids: no prompt text
        # vLLM's echo of a truncated text prompt: the text as sent (its renderer cuts only the ids), whole and streamed
        echoed = served.completions.create(model="smollm2", prompt=text, max_tokens=4, temperature=0.0, echo=True,
                                           extra_body=cut)
        assert echoed.choices[0].text == text + alone.choices[0].text and echoed.usage.prompt_tokens == 6
        if side == "left":
            chunks = served.completions.create(model="smollm2", prompt=text, max_tokens=4, temperature=0.0, echo=True,
                                               stream=True, extra_body=cut)
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == echoed.choices[0].text

    whole = served.completions.create(model="smollm2", prompt=text, max_tokens=2, temperature=0.0,
                                      extra_body={"truncate_prompt_tokens": -1, "return_token_ids": True})
    assert whole.usage.prompt_tokens == len(ids) and whole.choices[0].model_dump()["prompt_token_ids"] == ids

    msgs = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)  # newer transformers: a dict
    for side, kept in (("left", rendered[-8:]), ("right", rendered[:8])):
        chat = served.chat.completions.create(model="smollm2", messages=msgs, max_tokens=3, temperature=0.0,
                                              extra_body={"truncate_prompt_tokens": 8, "truncation_side": side,
                                                          "return_token_ids": True})
        assert chat.usage.prompt_tokens == 8 and chat.model_dump()["prompt_token_ids"] == kept
        alone = served.completions.create(model="smollm2", prompt=kept, max_tokens=3, temperature=0.0)
        assert chat.choices[0].message.content == alone.choices[0].text

    context = served.models.list().data[0].model_dump()["max_model_len"]
    for create, kw in ((served.completions.create, {"prompt": text}), (served.chat.completions.create, {"messages": msgs})):
        with pytest.raises(openai.BadRequestError) as info:
            create(model="smollm2", max_tokens=2, extra_body={"truncate_prompt_tokens": context + 1}, **kw)
        assert f"truncate_prompt_tokens value ({context + 1}) is greater than max_model_len ({context})" in \
            info.value.body["message"] and info.value.body["param"] == "truncate_prompt_tokens"


def test_completion_extensions_on_smollm2_logprobs_zero_token_id_names_and_usage_on_every_chunk(served, llm):
    """Issue 24 on the real engine: ``logprobs=0`` gives the sampled token's entry alone, ``return_tokens_as_token_ids``
    names tokens ``token_id:<id>``, and a completions stream with ``include_usage`` (and ``continuous_usage_stats``)
    counts the prompt as the worker's tokenizer does and the tokens so far on each chunk, then the usage chunk."""
    from pagestream.engine import SamplingParams

    tok = llm.get_tokenizer()
    prompt = "One, two, three, four,"
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=1), use_tqdm=False)[0].outputs[0]
    zero = served.completions.create(model="smollm2", prompt=prompt, max_tokens=5, temperature=0, logprobs=0)
    lp = zero.choices[0].logprobs
    assert zero.choices[0].text == ref.text and lp.tokens == [tok.decode([t]) for t in ref.token_ids]
    assert lp.token_logprobs == pytest.approx([d[t] for t, d in zip(ref.token_ids, ref.logprobs)], abs=1e-5)
    assert [list(tops) for tops in lp.top_logprobs] == [[t] for t in lp.tokens]  # the sampled token alone

    as_ids = served.completions.create(model="smollm2", prompt=prompt, max_tokens=5, temperature=0, logprobs=1,
                                       extra_body={"return_tokens_as_token_ids": True})
    assert as_ids.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ref.token_ids]

    prompt_tokens = len(tok.encode(prompt))
    chunks = list(served.completions.create(model="smollm2", prompt=prompt, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counted = [ch.usage for ch in chunks if ch.choices]
    assert counted and all(u.prompt_tokens == prompt_tokens for u in counted)
    assert [u.completion_tokens for u in counted] == sorted(u.completion_tokens for u in counted)
    assert counted[-1].completion_tokens == 5 and "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == prompt_tokens
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.total_tokens == prompt_tokens + 5


def test_prompt_logprobs_chat_echo_and_continue_final_message_on_smollm2(served, llm):
    """Issue 24 on the real engine: vLLM's ``prompt_logprobs`` on completions (per choice) and chat (on the response)
    equal the engine's own for the same prompt; chat's ``echo`` with ``continue_final_message`` leads the reply
    with the assistant's unfinished message and continues it as ``LLM.chat`` does."""
    from pagestream.engine import SamplingParams

    tok = llm.get_tokenizer()
    prompt = "The capital of France is"
    ids = tok.encode(prompt)
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    got = served.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    rows = got.choices[0].model_dump()["prompt_logprobs"]
    assert len(rows) == len(ids) and rows[0] is None
    for j in range(1, len(ids)):
        mine = rows[j][str(ids[j])]
        assert mine["logprob"] == pytest.approx(want.prompt_logprobs[j][ids[j]], abs=1e-4)
        assert mine["decoded_token"] == tok.decode([ids[j]])
        ranked = sorted((v for v in rows[j].values() if v["rank"] is not None), key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked] == [1, 2] and ranked[0]["logprob"] >= ranked[1]["logprob"]

    msgs = [{"role": "user", "content": "Name a colour."}]
    want_chat = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    chat = served.chat.completions.create(model="smollm2", messages=msgs, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 1, "return_token_ids": True}).model_dump()
    chat_ids = chat["prompt_token_ids"]
    assert chat_ids == list(want_chat.prompt_token_ids) and chat["prompt_logprobs"][0] is None
    assert [chat["prompt_logprobs"][j][str(chat_ids[j])]["logprob"] for j in range(1, len(chat_ids))] == \
        pytest.approx([want_chat.prompt_logprobs[j][chat_ids[j]] for j in range(1, len(chat_ids))], abs=1e-4)

    partial = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite colour is"}]
    cont = llm.chat(partial, SamplingParams(temperature=0, max_tokens=6), add_generation_prompt=False,
                    continue_final_message=True, use_tqdm=False)[0].outputs[0].text
    echoed = served.chat.completions.create(model="smollm2", messages=partial, max_tokens=6, temperature=0,
                                            extra_body={"echo": True, "add_generation_prompt": False,
                                                        "continue_final_message": True})
    assert echoed.choices[0].message.content == "My favourite colour is" + cont


def test_vllms_other_endpoints_and_400s_on_smollm2(served, smollm2_dir):
    """Issue 24 on ``pagestream serve``: the model object (``root`` the loaded path, ``max_model_len``, 404 for an
    unknown model), ``/version``, ``/ping``, ``/load``, ``/invocations`` by the body's shape, and vLLM's 400s naming
    the field for inputs it refuses before any step."""
    root = str(served.base_url).rstrip("/").rsplit("/v1", 1)[0]
    http = httpx.Client(base_url=root, timeout=120)
    model = served.models.retrieve("smollm2").model_dump()
    assert model["id"] == "smollm2" and model["parent"] is None and model["root"] == str(smollm2_dir)
    context = model["max_model_len"]
    assert isinstance(context, int) and context > 0
    with pytest.raises(openai.NotFoundError):
        served.models.retrieve("not-served")
    assert http.get("/version").json()["version"] not in ("", "unknown")
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    assert http.get("/load").json() == {"server_load": 0}

    done = http.post("/invocations", json={"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 3,
                                           "temperature": 0})
    plain = served.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=3, temperature=0)
    assert done.status_code == 200 and done.json()["choices"][0]["text"] == plain.choices[0].text
    chat = http.post("/invocations", json={"model": "smollm2", "max_tokens": 2,
                                           "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"

    vocab = 49152  # SmolLM2's
    r = redis.Redis.from_url(DB_URL)
    before = _lane_heads(r)
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for path, body, param in (
            ("/v1/completions", {"prompt": ""}, "prompt"), ("/v1/completions", {"prompt": [[1, "a"]]}, "prompt"),
            ("/v1/completions", {"prompt": "x", "stop_token_ids": [vocab + 5]}, "stop_token_ids"),
            ("/v1/completions", {"prompt": "x", "seed": 2**63}, "seed"),
            ("/v1/completions", {"prompt": "x", "max_tokens": context + 1}, "max_tokens"),
            # the served vocabulary is SmolLM2's (its worker announced it): the first id past it, and no negative id
            ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
            ("/v1/chat/completions", {**chat, "stop_token_ids": [0, vocab]}, "stop_token_ids"),
            ("/v1/completions", {"prompt": "x", "logit_bias": {str(vocab): 5}}, "logit_bias"),
            ("/v1/chat/completions", {**chat, "logit_bias": {"-2": 5}}, "logit_bias"),
            ("/v1/chat/completions", {**chat, "logit_bias": {"42": 100.5}}, "logit_bias"),
            ("/v1/completions", {"prompt": "x", "logit_bias": {"42": -101}}, "logit_bias")):
        resp = http.post(path, json={"model": "smollm2", "max_tokens": 2, **body})
        assert resp.status_code == 400, (body, resp.text)
        err = resp.json()["error"]
        assert err["message"] and (err["param"] or "").startswith(param.split("_")[0]), (body, err)
        if param in ("stop_token_ids", "logit_bias"):
            assert err["param"] == param and param in err["message"], (body, err)
    assert _lane_heads(r) == before  # not one job queued
    r.close()


#: a chat template of the request's own that reads a variable only ``chat_template_kwargs`` sets
SHOUT = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
         "{% if shout %}LOUDLY {% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _hf_chat_ids(tok, messages, **options) -> list[int]:
    """vLLM's chat prompt: transformers' ``apply_chat_template`` rendered to text, then encoded without special
    tokens (the template holds them)."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **options)
    return tok.encode(text, add_special_tokens=False)


def test_a_requests_chat_template_and_kwargs_make_the_prompt_transformers_renders_on_smollm2(served, smollm2_dir):
    """Issue 24: vLLM's ``chat_template`` (``--trust-request-chat-template``) and ``chat_template_kwargs`` on the real
    model: the prompt the worker ran (``return_token_ids``' prompt ids, ``usage.prompt_tokens``) is transformers'
    ``apply_chat_template`` with the same template and kwargs; a kwarg changes it, and on SmolLM2's own template a
    kwarg it does not read changes nothing. ``/tokenize`` takes the same options and gives the same ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    root = str(served.base_url).rstrip("/").rsplit("/v1", 1)[0]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    seen = []
    for template, kwargs in ((SHOUT, None), (SHOUT, {"shout": True}), (None, {"shout": True})):
        options = {**({"chat_template": template} if template else {}), **(kwargs or {})}
        want = _hf_chat_ids(tok, msgs, **options)
        extra = {"return_token_ids": True, **({"chat_template": template} if template else {}),
                 **({"chat_template_kwargs": kwargs} if kwargs else {})}
        got = served.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, temperature=0, extra_body=extra)
        assert got.model_dump()["prompt_token_ids"] == want and got.usage.prompt_tokens == len(want), options
        tokenized = httpx.post(f"{root}/tokenize", json={"model": "smollm2", "messages": msgs, **extra}, timeout=60).json()
        assert tokenized["tokens"] == want
        seen.append(want)
    assert seen[0] != seen[1] and tok.encode("LOUDLY", add_special_tokens=False)[0] in seen[1]  # the kwarg was read
    assert seen[2] == _hf_chat_ids(tok, msgs)  # the model's template ignores what it does not read


def test_tokenizer_endpoints_on_smollm2_answer_vllms_shapes_with_transformers_values(served, smollm2_dir):
    """Issue 24: ``/tokenizer_info`` (``--enable-tokenizer-info-endpoint``) is vLLM's ``TokenizerInfo``: the
    tokenizer's config (``init_kwargs``) without file paths, special tokens as their text, ``tokenizer_class`` and the
    chat template; each value equals SmolLM2's tokenizer's own. ``/tokenize`` and ``/detokenize`` equal transformers'."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    http = httpx.Client(base_url=str(served.base_url).rstrip("/").rsplit("/v1", 1)[0], timeout=60)
    info = http.get("/tokenizer_info").json()
    assert http.get("/tokenizer_info", params={"model": "smollm2"}).json() == info
    assert info["tokenizer_class"] == type(hf).__name__
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert info[name] == getattr(hf, name), name
    assert info["model_max_length"] == hf.model_max_length and info["chat_template"] == hf.chat_template
    assert info["added_tokens_decoder"] == {str(i): t.content for i, t in hf.added_tokens_decoder.items()}
    assert "vocab_file" not in info and "merges_file" not in info
    assert http.get("/tokenizer_info", params={"model": "not-served"}).status_code == 404

    prompt = "Paged attention keeps the KV cache in blocks, déjà vu!"
    got = http.post("/tokenize", json={"model": "smollm2", "prompt": prompt, "return_token_strs": True}).json()
    ids = hf.encode(prompt, add_special_tokens=True)
    assert got["tokens"] == ids and got["token_strs"] == hf.convert_ids_to_tokens(ids) and got["count"] == len(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV block?"}]
    chat = http.post("/tokenize", json={"model": "smollm2", "messages": messages, "return_token_strs": True}).json()
    chat_ids = _hf_chat_ids(hf, messages)
    assert chat["tokens"] == chat_ids and chat["token_strs"] == hf.convert_ids_to_tokens(chat_ids)
    assert http.post("/detokenize", json={"model": "smollm2", "tokens": ids}).json() == {"prompt": hf.decode(ids)}
    http.close()


def test_cached_tokens_on_smollm2_as_vllm_reports_them_whole_and_streamed(served, llm):
    """Issue 24: ``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``) on completions and
    chat, whole and in a stream's usage chunk: absent (null) for a request that hit nothing, as vLLM's serving code
    leaves it (``if enable_prompt_tokens_details and num_cached_tokens``); after the same prompt ran, the prompt's
    whole 16-token blocks but the last token's."""
    tok = llm.get_tokenizer()
    prefix = f"Session {uuid.uuid4().hex[:8]}. Facts: red squares, blue circles, green triangles, yellow stars, " \
             "purple hexagons and orange diamonds."
    prompt = prefix + " Which shape is blue?"
    n = len(tok.encode(prompt))
    assert n > 32
    kw = dict(model="smollm2", prompt=prompt, max_tokens=1, temperature=0)
    miss = served.completions.create(**kw)
    assert miss.usage.prompt_tokens == n and miss.usage.prompt_tokens_details is None
    whole = served.completions.create(**kw)
    assert whole.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    streamed = list(served.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].choices == [] and streamed[-1].usage.model_dump() == whole.usage.model_dump()

    msgs = [{"role": "system", "content": prefix}, {"role": "user", "content": "Which shape is green?"}]
    kw = dict(model="smollm2", messages=msgs, max_tokens=1, temperature=0)
    miss = served.chat.completions.create(**kw)
    assert miss.usage.prompt_tokens_details is None
    whole = served.chat.completions.create(**kw)
    assert whole.usage.prompt_tokens_details.cached_tokens == (whole.usage.prompt_tokens - 1) // 16 * 16
    streamed = list(served.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].choices == [] and streamed[-1].usage.model_dump() == whole.usage.model_dump()


def test_chat_stream_options_on_smollm2_count_what_the_whole_request_counts(served):
    """Issue 24: chat's ``stream_options`` on the real model. ``include_usage``: one last chunk, no choices, with the
    usage the same request not streamed has; ``continuous_usage_stats`` too: every chunk carries the prompt's size and
    the tokens so far (vLLM's role chunk: 0), ending at the whole request's count."""
    msgs = [{"role": "user", "content": "Count from one to five."}]
    kw = dict(model="smollm2", messages=msgs, max_tokens=6, temperature=0)
    whole = served.chat.completions.create(**kw)

    def counts(u):
        return u.prompt_tokens, u.completion_tokens, u.total_tokens

    only = list(served.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert [c.usage is None for c in only] == [True] * (len(only) - 1) + [False] and only[-1].choices == []
    assert counts(only[-1].usage) == counts(whole.usage)
    assert "".join(c.choices[0].delta.content or "" for c in only if c.choices) == whole.choices[0].message.content

    every = list(served.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True,
                                                                                 "continuous_usage_stats": True}))
    assert every[-1].choices == [] and counts(every[-1].usage) == counts(whole.usage)
    running = [c.usage for c in every if c.choices]
    assert running and all(u is not None and u.prompt_tokens == whole.usage.prompt_tokens for u in running)
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in running)
    done = [u.completion_tokens for u in running]
    assert done == sorted(done) and done[0] == 0 and done[-1] == whole.usage.completion_tokens

"""vLLM's ``num_cached_tokens`` / ``usage.prompt_tokens_details.cached_tokens``: the prompt tokens a request found in
the prefix cache when first scheduled. Offline (``LLM.generate``, in-process and through the engine process), and
end to end through the official openai client against ``pagestream serve --enable-prompt-tokens-details`` on a tiny
llama on the CPU (whole and streamed responses, chat and completions), beside a gateway without the flag on the same
Redis. As in vLLM, a request that hit nothing has no ``prompt_tokens_details`` (null) even with the flag on."""
from __future__ import annotations

import uuid

import openai
import pytest
import redis

from gateway_helpers import DB_URL, GatewayProc, ServeProc
from pagestream.engine import LLM, SamplingParams
from pagestream.producer.gateway.protocol import total_usage
from pagestream.producer.protocol.openai import usage
from pagestream.producer.protocol.schema import JobResult, JobStatus

MODEL = "tiny-cached"
BLOCK = 16  # EngineConfig.block_size's default, what serve runs with
SHARED = [7 + (i * 37) % 900 for i in range(5 * BLOCK + 3)]  # 5 full blocks and a bit


def _prompts(tail_a: int, tail_b: int) -> tuple[list[int], list[int]]:
    return [*SHARED, tail_a, tail_a + 1], [*SHARED, tail_b, tail_b + 1, tail_b + 2]


def test_generate_reports_the_prefix_cache_hit_of_a_shared_prefix(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu", max_num_seqs=4, max_model_len=256, seed=0)
    a, b = _prompts(950, 960)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    (first,) = llm.generate(prompt_token_ids=[a], sampling_params=params, use_tqdm=False)
    (second,) = llm.generate(prompt_token_ids=[b], sampling_params=params, use_tqdm=False)
    (again,) = llm.generate(prompt_token_ids=[b], sampling_params=params, use_tqdm=False)
    assert first.num_cached_tokens == 0
    shared_blocks = len(SHARED) // BLOCK * BLOCK
    assert second.num_cached_tokens >= shared_blocks
    assert second.num_cached_tokens % BLOCK == 0 and second.num_cached_tokens < len(b)
    # the same prompt again: every full block of it (never the whole prompt: its last token is computed)
    assert again.num_cached_tokens == (len(b) - 1) // BLOCK * BLOCK
    assert first.outputs[0].token_ids and second.outputs[0].token_ids


def _drive(engine, rid: str, ids: list[int], resume: list[int] | None = None, n: int = 1) -> list:
    engine.add_request(rid, prompt_token_ids=ids, resume_token_ids=resume,
                       params=SamplingParams(temperature=0.5, seed=1, n=n, max_tokens=4, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs and outs[-1].finished
    return outs


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
def test_the_engine_reports_it_on_its_outputs(tiny_llama_dir, engine_process):
    """Every output of a request carries it (delta outputs, n > 1, a resumed request), in-process and across the
    engine process's pipe alike; a resumed request counts prompt tokens only, never its resumed output tokens."""
    from pagestream.engine import LLMEngine
    from pagestream.engine.config import EngineConfig
    from pagestream.engine.engine_process import EngineProcess

    cfg = EngineConfig(model=tiny_llama_dir, device="cpu", max_num_seqs=4, max_model_len=256, seed=0)
    engine = EngineProcess(cfg) if engine_process else LLMEngine(cfg)
    try:
        a, b = _prompts(900, 910)
        assert {o.num_cached_tokens for o in _drive(engine, "a", a)} == {0}
        outs = _drive(engine, "b", b, n=2)
        assert {o.num_cached_tokens for o in outs} == {len(SHARED) // BLOCK * BLOCK}
        # resumed: a's run left 5 blocks cached, more than this 70-token prompt: only its prompt tokens count
        resumed = _drive(engine, "c", a[:70], resume=a[70:])
        assert len(a) - 1 >= 5 * BLOCK and resumed[-1].num_cached_tokens == 70
    finally:
        if engine_process:
            engine.close()


def test_usage_has_prompt_tokens_details_only_when_asked_and_hit():
    hit = JobResult(job_id="a", status=JobStatus.COMPLETED, prompt_tokens=40, completion_tokens=2, num_cached_tokens=32)
    miss = JobResult(job_id="b", status=JobStatus.COMPLETED, prompt_tokens=40, completion_tokens=2)
    assert "prompt_tokens_details" not in usage(hit)
    assert usage(hit, True)["prompt_tokens_details"] == {"cached_tokens": 32}
    assert "prompt_tokens_details" not in usage(miss, True)  # vLLM: null for a miss
    assert total_usage([hit, miss, hit], True) == {"prompt_tokens": 120, "completion_tokens": 6, "total_tokens": 126,
                                                   "prompt_tokens_details": {"cached_tokens": 64}}
    assert "prompt_tokens_details" not in total_usage([hit], False)
    # a result written before the field existed reads as 0
    assert JobResult.model_validate_json(miss.model_dump_json(exclude={"num_cached_tokens"})).num_cached_tokens == 0


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, tmp_path_factory):
    """``serve --enable-prompt-tokens-details`` (the worker, one gateway) and a gateway without the flag."""
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    log_dir = tmp_path_factory.mktemp("cached-tokens")
    serve = ServeProc(tiny_llama_dir, "--served-model-name", MODEL, "--max-num-seqs", "4",
                      "--enable-prompt-tokens-details", "--no-bulk-worker", log_dir=log_dir)
    plain = GatewayProc(DB_URL, log_dir=log_dir)
    try:
        serve.wait_ready()
        plain.wait_ready()
        yield {"on": openai.OpenAI(base_url=serve.base_url, api_key="unused", max_retries=0, timeout=300),
               "off": openai.OpenAI(base_url=plain.base_url, api_key="unused", max_retries=0, timeout=300)}
    finally:
        plain.stop()
        serve.stop()
        r.flushdb()
        r.close()


def _long_prefix() -> str:
    """A prefix no other test sent (so the first request misses), long enough for several blocks."""
    tag = uuid.uuid4().hex
    return f"Context {tag}. " + " ".join(f"item {i} is {tag[i % 32]}{i * 7};" for i in range(40))


def _cached(u) -> int | None:
    d = u.prompt_tokens_details
    return None if d is None else d.cached_tokens


def test_completions_report_cached_tokens_of_a_shared_prefix(stack):
    client = stack["on"]
    prefix = _long_prefix()
    first = client.completions.create(model=MODEL, prompt=prefix + " Question one?", max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prefix + " Another, second question?", max_tokens=2,
                                       temperature=0)
    assert first.usage.prompt_tokens > 5 * BLOCK
    assert _cached(first.usage) is None  # a miss: vLLM leaves prompt_tokens_details out
    cached = _cached(second.usage)
    assert cached is not None and cached > 0 and cached % BLOCK == 0
    assert cached >= 4 * BLOCK and cached < second.usage.prompt_tokens
    # a list of prompts: the cached tokens of each, summed (the same prompt twice after the second: both hit)
    both = client.completions.create(model=MODEL, prompt=[prefix + " Another, second question?"] * 2, max_tokens=2,
                                     temperature=0)
    assert _cached(both.usage) == 2 * ((second.usage.prompt_tokens - 1) // BLOCK * BLOCK)


def test_chat_reports_cached_tokens_whole_and_streamed(stack):
    client = stack["on"]
    prefix = _long_prefix()

    def ask(question: str, **kw):
        return client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": prefix}, {"role": "user", "content": question}], **kw)

    first = ask("Why?")
    assert _cached(first.usage) is None
    second = ask("And then what happened?")
    cached = _cached(second.usage)
    assert cached is not None and cached > 0 and cached % BLOCK == 0 and cached >= 4 * BLOCK

    chunks = list(ask("A streamed question at last?", stream=True, stream_options={"include_usage": True}))
    (last,) = [c for c in chunks if c.usage is not None]
    assert last is chunks[-1] and not last.choices
    streamed = _cached(last.usage)
    assert streamed is not None and streamed > 0 and streamed % BLOCK == 0 and streamed >= 4 * BLOCK

    # a streamed miss: no details in the usage chunk
    fresh = list(client.chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "system", "content": _long_prefix()}, {"role": "user", "content": "Hi"}]))
    assert fresh[-1].usage is not None and _cached(fresh[-1].usage) is None


def test_without_the_flag_there_are_no_prompt_tokens_details(stack):
    on, off = stack["on"], stack["off"]
    prefix = _long_prefix()
    on.completions.create(model=MODEL, prompt=prefix + " warm", max_tokens=2, temperature=0)
    hit = off.completions.create(model=MODEL, prompt=prefix + " the same prefix again", max_tokens=2, temperature=0)
    assert hit.usage.prompt_tokens_details is None
    chat = off.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                       messages=[{"role": "system", "content": prefix}, {"role": "user", "content": "x"}])
    assert chat.usage.prompt_tokens_details is None
    chunks = list(off.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, stream=True,
                                              stream_options={"include_usage": True},
                                              messages=[{"role": "system", "content": prefix},
                                                        {"role": "user", "content": "y"}]))
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details is None
    # the same request through the gateway with the flag hits the cache (so the one above would have shown it)
    seen = on.completions.create(model=MODEL, prompt=prefix + " the same prefix again", max_tokens=2, temperature=0)
    assert (_cached(seen.usage) or 0) > 0

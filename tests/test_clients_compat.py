"""Issue 24, acceptance 3: the clients a team already has, pointed at ``pagestream serve``.

LangChain (``langchain-openai``: ``ChatOpenAI`` and ``OpenAI``; invoke, stream, batch, async,
``with_structured_output``) and LiteLLM's OpenAI-compatible provider (``openai/<name>``: completion,
stream with usage, text completion, logprobs, ``n``, its exception types) are driven as a user drives
them, and the tests assert what that user notices. One module-scoped ``pagestream serve`` on
SmolLM2 (CPU) answers where the text matters (stream equals invoke, structured output parses); a
fake-engine worker on the same Redis serves ``fake-model`` through the same gateway where it does not.

Both libraries are kept off the network and imported at first use (tests/client_libs.py).
"""
from __future__ import annotations

import asyncio
import pytest
import redis

from pydantic import BaseModel

from client_libs import langchain_openai, litellm  # imported at first use
from gateway_helpers import DB_URL, ServeProc
from pagestream.producer import Producer
from pagestream.worker.fake_engine import FakeTokenizer
from private_redis import free_port
from queue_helpers import WorkerProc, wait_for

pytestmark = [pytest.mark.slow,
              # LiteLLM's own pydantic models warn at import (ReadOnly TypedDicts, deprecated attribute access)
              pytest.mark.filterwarnings("ignore:.*ReadOnly:UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

SMOL = "smollm2"
FAKE = "fake-model"
KEY = "sk-unused"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def base_url(smollm2_dir, tmp_path_factory):
    """``pagestream serve`` on SmolLM2 and a fake worker beside it, both announced to the one gateway."""
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    log_dir = tmp_path_factory.mktemp("clients")
    serve = ServeProc(smollm2_dir, "--served-model-name", SMOL, "--max-num-seqs", "4", "--no-bulk-worker", log_dir=log_dir,
                      env={"PAGESTREAM_GATEWAY_FILES_URI": str(log_dir / "files"), "PAGESTREAM_METRICS_PORT": str(free_port())})
    fake = WorkerProc(DB_URL, "fake:1", "clients-fake", "--served-model-name", FAKE, log_dir=log_dir)
    try:
        fake.wait_ready()
        serve.wait_ready()
        wait_for(lambda: {SMOL, FAKE} <= set(Producer(r).live_models()), 60, "both models announced")
        yield serve.base_url
    finally:
        fake.stop()
        serve.stop()
        r.flushdb()
        r.close()


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def chat_prompt_tokens(tok, text: str) -> int:
    """What the worker counts for one user message: the chat template's tokens with the generation prompt."""
    return len(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"])


def fake_chat_tokens(text: str) -> int:
    return len(FakeTokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=True))


def lc_chat(base_url: str, model: str, **kw):
    return langchain_openai.ChatOpenAI(model=model, base_url=base_url, api_key=KEY, max_retries=0, timeout=120,
                                       **{"temperature": 0, "seed": 1, "max_tokens": MAX_TOKENS, **kw})


def lc_llm(base_url: str, model: str, **kw):
    return langchain_openai.OpenAI(model=model, base_url=base_url, api_key=KEY, max_retries=0, timeout=120,
                                   **{"temperature": 0, "seed": 1, "max_tokens": MAX_TOKENS, **kw})


# -- LangChain ---------------------------------------------------------------------------------------


def test_langchain_chat_stream_concatenates_to_the_invoke_answer_with_the_same_usage(base_url, tok):
    chat = lc_chat(base_url, SMOL, stream_usage=True)
    q = "Name a colour."
    msg = chat.invoke(q)
    assert msg.content.strip()
    assert msg.response_metadata["finish_reason"] == "length" and msg.response_metadata["model_name"] == SMOL
    usage = msg.usage_metadata
    assert usage["input_tokens"] == chat_prompt_tokens(tok, q)
    assert usage["output_tokens"] == MAX_TOKENS and usage["total_tokens"] == usage["input_tokens"] + MAX_TOKENS

    chunks = list(chat.stream(q))
    assert len(chunks) > 2  # token by token, not one blob
    whole = chunks[0]
    for c in chunks[1:]:
        whole += c
    assert whole.content == msg.content
    assert whole.usage_metadata["input_tokens"] == usage["input_tokens"]
    assert whole.usage_metadata["output_tokens"] == usage["output_tokens"]


def test_langchain_chat_batch_and_async_answer_each_prompt_in_order(base_url):
    chat = lc_chat(base_url, FAKE)
    prompts = ["one", "two words", "three words here"]
    singles = [chat.invoke(p).content for p in prompts]
    assert len(set(singles)) == 3 and all(singles)
    assert [m.content for m in chat.batch(prompts)] == singles
    assert [m.usage_metadata["input_tokens"] for m in chat.batch(prompts)] == [fake_chat_tokens(p) for p in prompts]

    async def run():
        got = await chat.abatch(prompts)
        streamed = "".join([c.content async for c in chat.astream(prompts[1])])
        return [m.content for m in got], (await chat.ainvoke(prompts[1])).content, streamed

    batched, single, streamed = asyncio.run(run())
    assert batched == singles and single == singles[1] and streamed == singles[1]


def test_langchain_completions_llm_invoke_stream_and_batch(base_url, tok):
    llm = lc_llm(base_url, SMOL)
    prompt = "The capital of France is"
    text = llm.invoke(prompt)
    assert text.strip()
    pieces = list(llm.stream(prompt))
    assert len(pieces) > 2 and "".join(pieces) == text
    gen = llm.generate([prompt])
    assert gen.generations[0][0].text == text
    usage = gen.llm_output["token_usage"]
    assert usage["prompt_tokens"] == len(tok(prompt)["input_ids"]) and usage["completion_tokens"] == MAX_TOKENS

    # a batch is one request with a list of prompts (LangChain's batch_size): answers in prompt order
    fake = lc_llm(base_url, FAKE)
    prompts = ["a", "b c", "d e f", "g h i j"]
    singles = [fake.invoke(p) for p in prompts]
    assert len(set(singles)) == 4
    assert fake.batch(prompts) == singles
    assert asyncio.run(fake.abatch(prompts)) == singles


class City(BaseModel):
    name: str
    country: str


@pytest.mark.parametrize("method", ["json_schema", "json_mode"])
def test_langchain_structured_output_parses_into_the_pydantic_model(base_url, method):
    chat = lc_chat(base_url, SMOL, max_tokens=60, seed=None)
    structured = chat.with_structured_output(City, method=method, include_raw=True)
    out = structured.invoke("Describe Paris as JSON with the keys name and country.")
    assert out["parsing_error"] is None, out["raw"].content
    assert isinstance(out["parsed"], City) and out["parsed"].name
    assert out["raw"].response_metadata["finish_reason"] == "stop"  # the grammar ended it, not max_tokens


# -- LiteLLM -----------------------------------------------------------------------------------------


def ll_kw(base_url: str) -> dict:
    return {"api_base": base_url, "api_key": KEY, "timeout": 120}


MSGS = [{"role": "user", "content": "Name a colour."}]


def test_litellm_completion_and_stream_with_usage(base_url, tok):
    kw = {**ll_kw(base_url), "model": f"openai/{SMOL}", "messages": MSGS, "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 1}
    resp = litellm.completion(**kw)
    text = resp.choices[0].message.content
    assert text.strip() and resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == chat_prompt_tokens(tok, MSGS[0]["content"])
    assert resp.usage.completion_tokens == MAX_TOKENS
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + MAX_TOKENS

    chunks = list(litellm.completion(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    usages = [c.usage for c in chunks if getattr(c, "usage", None) is not None]
    assert usages and usages[-1].prompt_tokens == resp.usage.prompt_tokens
    assert usages[-1].completion_tokens == MAX_TOKENS
    rebuilt = litellm.stream_chunk_builder(chunks, messages=MSGS)
    assert rebuilt.choices[0].message.content == text and rebuilt.usage.completion_tokens == MAX_TOKENS


def test_litellm_text_completion_and_its_stream(base_url, tok):
    prompt = "The capital of France is"
    kw = {**ll_kw(base_url), "model": f"openai/{SMOL}", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 1}
    resp = litellm.text_completion(**kw)
    text = resp.choices[0].text
    assert text.strip()
    assert resp.usage.prompt_tokens == len(tok(prompt)["input_ids"]) and resp.usage.completion_tokens == MAX_TOKENS
    chunks = list(litellm.text_completion(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text or "" for c in chunks if c.choices) == text
    assert [c.usage.completion_tokens for c in chunks if c.usage is not None] == [MAX_TOKENS]
    # LangChain's completions LLM and LiteLLM's text completion see the same greedy answer
    assert lc_llm(base_url, SMOL).invoke(prompt) == text


def test_litellm_logprobs_one_entry_per_generated_token(base_url):
    kw = {**ll_kw(base_url), "model": f"openai/{FAKE}", "max_tokens": 5}
    resp = litellm.completion(**kw, messages=MSGS, logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 5
    assert "".join(e.token for e in content) == resp.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)

    text = litellm.text_completion(**kw, prompt="x y", logprobs=2)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == text.usage.completion_tokens == 5
    assert "".join(lp.tokens) == text.choices[0].text
    assert all(len(t) >= 2 for t in lp.top_logprobs)


def test_litellm_n_samples_are_n_choices(base_url):
    resp = litellm.completion(**ll_kw(base_url), model=f"openai/{FAKE}", messages=MSGS, max_tokens=4, n=3, temperature=1.0, seed=5)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert len({c.message.content for c in resp.choices}) == 3
    assert resp.usage.completion_tokens == 3 * 4 and resp.usage.prompt_tokens == fake_chat_tokens(MSGS[0]["content"])

    async def stream():  # acompletion's stream: every choice's text, and one usage for all of them
        texts, usage = {}, None
        async for c in await litellm.acompletion(**ll_kw(base_url), model=f"openai/{FAKE}", messages=MSGS, max_tokens=4, n=3,
                                                 temperature=1.0, seed=5, stream=True, stream_options={"include_usage": True}):
            for ch in c.choices:
                texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            usage = getattr(c, "usage", None) or usage
        return texts, usage

    texts, usage = asyncio.run(stream())
    assert texts == {c.index: c.message.content for c in resp.choices}
    assert usage.completion_tokens == 3 * 4


def test_litellm_raises_its_own_exception_types(base_url):
    kw = ll_kw(base_url)
    with pytest.raises(litellm.NotFoundError, match="nope"):
        litellm.completion(**kw, model="openai/nope", messages=MSGS, max_tokens=4)
    with pytest.raises(litellm.NotFoundError):
        litellm.text_completion(**kw, model="openai/nope", prompt="x", max_tokens=4)

    async def missing():
        await litellm.acompletion(**kw, model="openai/nope", messages=MSGS, max_tokens=4)

    with pytest.raises(litellm.NotFoundError):
        asyncio.run(missing())
    with pytest.raises(litellm.BadRequestError):
        litellm.completion(**kw, model=f"openai/{FAKE}", messages=MSGS, max_tokens=4, temperature=-1)


def test_litellm_sees_a_context_overflow_as_context_window_exceeded(base_url):
    """LiteLLM's Router falls back to a longer-context model on ContextWindowExceededError (a 400 in vLLM's
    words); a 500 would be retried and cool the deployment down instead."""
    kw = ll_kw(base_url)
    with pytest.raises(litellm.ContextWindowExceededError):  # refused at the gateway: max_tokens alone fills the context
        litellm.completion(**kw, model=f"openai/{FAKE}", messages=MSGS, max_tokens=100_000)
    long_prompt = "w " * 600  # fake-model's context is 512 tokens: the worker's engine refuses it
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(**kw, model=f"openai/{FAKE}", messages=[{"role": "user", "content": long_prompt}], max_tokens=4)
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.text_completion(**kw, model=f"openai/{FAKE}", prompt=long_prompt, max_tokens=4)
    with pytest.raises(litellm.ContextWindowExceededError):  # the real engine's refusal of a prompt past 8192 tokens
        litellm.completion(**kw, model=f"openai/{SMOL}", messages=[{"role": "user", "content": "hi " * 9000}], max_tokens=4)


def test_langchain_tool_calls_are_refused_not_answered_as_plain_text(base_url):
    """Tools are answered since issue 26 (tests/test_tool_calls.py); here what cannot be answered is a 400 that
    says why, never plain text as if the tools were not there: stock SmolLM2's template has no tool format, and
    this gateway has no --tool-call-parser for ``auto`` (bind_tools' default)."""
    import openai

    with pytest.raises(openai.BadRequestError, match="has no tool format"):
        lc_chat(base_url, SMOL).with_structured_output(City, method="function_calling").invoke("Paris?")
    chat = lc_chat(base_url, FAKE)
    with pytest.raises(openai.BadRequestError, match="requires --enable-auto-tool-choice and --tool-call-parser"):
        chat.bind_tools([City]).invoke("Paris?")
    assert chat.bind_tools([City], tool_choice="none").invoke("Paris?").content  # no calls read, as asked

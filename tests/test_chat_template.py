"""vLLM's chat-template options (the "vLLM surface" issue): ``add_generation_prompt``, ``continue_final_message``,
``chat_template`` (only with ``--trust-request-chat-template``) and ``chat_template_kwargs``, through the official
openai client against ``pagestream serve`` on a tiny llama (SmolLM2's tokenizer and template) on the CPU, through
``/tokenize``, and offline through ``LLM.chat``. The prompt the worker used (``return_token_ids``' prompt ids and
``usage.prompt_tokens``) must equal transformers' ``apply_chat_template`` with the same options."""
from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest
import redis
from pydantic import ValidationError

from gateway_helpers import DB_URL, GatewayProc, ServeProc
from pagestream.producer.protocol.limits import job_limits
from pagestream.producer.protocol.schema import JobRequest

MODEL = "tiny-template"
USER = [{"role": "user", "content": "Name a colour."}]
PREFIX = [*USER, {"role": "assistant", "content": "My favourite colour is"}]
#: a template of the request's own that reads a variable only ``chat_template_kwargs`` sets
SHOUT = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
         "{% if shout %}LOUDLY {% endif %}{% if add_generation_prompt %}<assistant>{% endif %}")
RAISES = "{{ raise_exception('this template refuses every conversation') }}"


def hf_ids(tok, messages, **options) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, **options)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, tmp_path_factory):
    """``serve`` (worker + a gateway that trusts request templates) and a second gateway, on the same Redis, that
    does not (the default)."""
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    log_dir = tmp_path_factory.mktemp("chat-template")
    serve = ServeProc(tiny_llama_dir, "--served-model-name", MODEL, "--max-num-seqs", "4", "--trust-request-chat-template",
                      "--no-bulk-worker", log_dir=log_dir)
    plain = GatewayProc(DB_URL, log_dir=log_dir)
    try:
        serve.wait_ready()
        plain.wait_ready()
        client = openai.OpenAI(base_url=serve.base_url, api_key="unused", max_retries=0, timeout=300)
        untrusted = openai.OpenAI(base_url=plain.base_url, api_key="unused", max_retries=0, timeout=300)
        yield {"trusted": client, "untrusted": untrusted,
               "http": httpx.Client(base_url=serve.base_url.removesuffix("/v1"), timeout=300),
               "plain_http": httpx.Client(base_url=plain.base_url.removesuffix("/v1"), timeout=300)}
    finally:
        plain.stop()
        serve.stop()
        r.flushdb()
        r.close()


def chat(client, messages, **extra):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"return_token_ids": True, **extra})


def prompt_ids(resp) -> list[int]:
    ids = resp.model_extra["prompt_token_ids"]
    assert len(ids) == resp.usage.prompt_tokens
    return ids


# ---- through the gateway and a real worker ----------------------------------------------------------------------

def test_add_generation_prompt_false_renders_without_the_assistant_header(stack, tok):
    default = prompt_ids(chat(stack["trusted"], USER))
    assert default == hf_ids(tok, USER, add_generation_prompt=True)
    got = prompt_ids(chat(stack["trusted"], USER, add_generation_prompt=False))
    assert got == hf_ids(tok, USER, add_generation_prompt=False)
    assert got != default and not tok.decode(got).rstrip().endswith("assistant")


def test_continue_final_message_continues_the_assistant_prefix(stack, tok):
    got = prompt_ids(chat(stack["trusted"], PREFIX, add_generation_prompt=False, continue_final_message=True))
    assert got == hf_ids(tok, PREFIX, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(got).endswith("My favourite colour is")  # no end-of-turn after the prefix

    with pytest.raises(openai.BadRequestError, match="continue_final_message"):  # both on: vLLM's 400
        chat(stack["trusted"], PREFIX, continue_final_message=True)


def test_a_request_template_reads_chat_template_kwargs(stack, tok):
    loud = prompt_ids(chat(stack["trusted"], USER, chat_template=SHOUT, chat_template_kwargs={"shout": True}))
    assert loud == hf_ids(tok, USER, chat_template=SHOUT, add_generation_prompt=True, shout=True)
    assert "LOUDLY" in tok.decode(loud)
    quiet = prompt_ids(chat(stack["trusted"], USER, chat_template=SHOUT))
    assert quiet == hf_ids(tok, USER, chat_template=SHOUT, add_generation_prompt=True) and "LOUDLY" not in tok.decode(quiet)
    # streamed too, with the prompt options
    chunks = stack["trusted"].chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"chat_template": SHOUT, "chat_template_kwargs": {"shout": True}, "add_generation_prompt": False})
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage[-1].prompt_tokens == len(hf_ids(tok, USER, chat_template=SHOUT, add_generation_prompt=False, shout=True))


def test_a_request_template_is_refused_unless_the_gateway_trusts_them(stack):
    for extra in ({"chat_template": SHOUT}, {"chat_template_kwargs": {"chat_template": SHOUT}}):
        with pytest.raises(openai.BadRequestError) as err:
            chat(stack["untrusted"], USER, **extra)
        assert "--trust-request-chat-template" in err.value.message
        assert "PAGESTREAM_GATEWAY_TRUST_REQUEST_CHAT_TEMPLATE" in err.value.message
    resp = stack["plain_http"].post("/tokenize", json={"model": MODEL, "messages": USER, "chat_template": SHOUT})
    assert resp.status_code == 400 and "--trust-request-chat-template" in resp.json()["error"]["message"]
    # the model's own template with kwargs needs no trust
    assert chat(stack["untrusted"], USER, chat_template_kwargs={"enable_thinking": False}).usage.prompt_tokens > 0


@pytest.mark.parametrize("key", ["add_generation_prompt", "tokenize", "messages", "tools", "chat_template"])
def test_a_reserved_key_in_chat_template_kwargs_is_a_400_naming_it(stack, key):
    with pytest.raises(openai.BadRequestError) as err:
        chat(stack["trusted"], USER, chat_template_kwargs={key: False})
    assert f"may not set '{key}'" in err.value.message
    assert err.value.param == "chat_template_kwargs"


def test_chat_template_kwargs_must_be_a_bounded_object(stack):
    with pytest.raises(openai.BadRequestError):
        chat(stack["trusted"], USER, chat_template_kwargs=["not", "an", "object"])
    big = {"x": "a" * (job_limits().max_chat_template_kwargs_bytes + 1)}
    with pytest.raises(openai.BadRequestError, match="PAGESTREAM_MAX_CHAT_TEMPLATE_KWARGS_BYTES"):
        chat(stack["trusted"], USER, chat_template_kwargs=big)
    huge = "{# pad #}" * (job_limits().max_chat_template_bytes // 9 + 1)
    with pytest.raises(openai.BadRequestError, match="PAGESTREAM_MAX_CHAT_TEMPLATE_BYTES"):
        chat(stack["trusted"], USER, chat_template=huge + SHOUT)


def test_a_template_that_raises_fails_its_request_alone_and_the_worker_serves_on(stack, tok):
    with pytest.raises(openai.BadRequestError, match="this template refuses every conversation"):
        chat(stack["trusted"], USER, chat_template=RAISES)
    # a broken template beside good requests at once: each good one is answered, the bad one is a 400
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        bad = pool.submit(chat, stack["trusted"], USER, chat_template="{% for %}")
        good = [pool.submit(chat, stack["trusted"], USER, add_generation_prompt=False) for _ in range(3)]
        with pytest.raises(openai.BadRequestError, match="TemplateSyntaxError"):
            bad.result(timeout=300)
        want = hf_ids(tok, USER, add_generation_prompt=False)
        assert all(prompt_ids(g.result(timeout=300)) == want for g in good)
    assert prompt_ids(chat(stack["trusted"], USER)) == hf_ids(tok, USER, add_generation_prompt=True)


def test_tokenize_takes_the_same_options(stack, tok):
    body = {"model": MODEL, "messages": USER, "chat_template": SHOUT, "chat_template_kwargs": {"shout": True},
            "add_generation_prompt": False}
    resp = stack["http"].post("/tokenize", json=body)
    assert resp.status_code == 200, resp.text
    text = tok.apply_chat_template(USER, tokenize=False, chat_template=SHOUT, add_generation_prompt=False, shout=True)
    assert resp.json()["tokens"] == tok.encode(text, add_special_tokens=False)
    bad = stack["http"].post("/tokenize", json={**body, "chat_template_kwargs": {"tokenize": False}})
    assert bad.status_code == 400 and "may not set 'tokenize'" in bad.json()["error"]["message"]
    raises = stack["http"].post("/tokenize", json={**body, "chat_template": RAISES})
    assert raises.status_code == 400 and "this template refuses every conversation" in raises.json()["error"]["message"]


# ---- offline ------------------------------------------------------------------------------------------------------

def test_llm_chat_takes_vllms_template_options(tiny_llama_dir, tok):
    from pagestream.engine import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, device="cpu", max_num_seqs=2, seed=0)
    params = SamplingParams(max_tokens=1, temperature=0)

    def used(messages, **options) -> list[int]:
        return llm.chat(messages, params, use_tqdm=False, **options)[0].prompt_token_ids

    assert used(USER) == hf_ids(tok, USER, add_generation_prompt=True)
    assert used(USER, add_generation_prompt=False) == hf_ids(tok, USER, add_generation_prompt=False)
    assert (used(PREFIX, add_generation_prompt=False, continue_final_message=True)
            == hf_ids(tok, PREFIX, add_generation_prompt=False, continue_final_message=True))
    assert (used(USER, chat_template=SHOUT, chat_template_kwargs={"shout": True})
            == hf_ids(tok, USER, chat_template=SHOUT, add_generation_prompt=True, shout=True))
    with pytest.raises(ValueError, match="this template refuses every conversation"):
        llm.chat(USER, params, use_tqdm=False, chat_template=RAISES)
    with pytest.raises(ValueError, match="may not set 'tokenize'"):
        llm.chat(USER, params, use_tqdm=False, chat_template_kwargs={"tokenize": False})
    assert used(USER) == hf_ids(tok, USER, add_generation_prompt=True)  # the engine serves on


# ---- the job schema and bulk lines (no server) --------------------------------------------------------------------

def test_the_job_schema_bounds_and_checks_the_options():
    msgs = [{"role": "user", "content": "hi"}]
    job = JobRequest(messages=msgs, add_generation_prompt=False, chat_template_kwargs={"enable_thinking": False})
    assert JobRequest.model_validate_json(job.model_dump_json(exclude_none=True)) == job
    plain = json.loads(JobRequest(messages=msgs).model_dump_json(exclude_none=True))
    assert not {"add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs"} & set(plain)
    for bad, words in [
        (dict(prompt="hi", add_generation_prompt=False), "need messages"),
        (dict(messages=msgs, continue_final_message=True), "Cannot set both"),
        (dict(messages=msgs, chat_template_kwargs={"return_tensors": "pt"}), "may not set 'return_tensors'"),
        (dict(messages=msgs, chat_template_kwargs={"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {}}}}}}}}}), "nested deeper"),
        (dict(messages=msgs, chat_template=""), "must not be empty"),
    ]:
        with pytest.raises(ValidationError, match=words):
            JobRequest(**bad)


def test_bulk_lines_carry_the_prompt_options_and_refuse_a_request_template():
    from pagestream.producer.bulk.io import BadLine, parse_line

    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False,
                     "chat_template_kwargs": {"enable_thinking": False}}}
    req = parse_line(json.dumps(line), 1)
    assert req.body.template_options() == {"add_generation_prompt": False, "chat_template_kwargs": {"enable_thinking": False}}
    refused = parse_line(json.dumps({**line, "body": {**line["body"], "chat_template": SHOUT}}), 2)
    assert isinstance(refused, BadLine) and "chat_template in batch lines is not supported" in refused.reason

    from pagestream.producer.bulk.orchestrator import bulk_job
    from pagestream.producer.bulk.api import BulkSpec

    spec = BulkSpec(bulk_id="batch_ct", input="/in.jsonl", output="/out")
    job = JobRequest(**bulk_job(req, spec))  # what the worker gets for the line
    assert job.add_generation_prompt is False and job.chat_template_kwargs == {"enable_thinking": False}
    reserved = parse_line(json.dumps({**line, "body": {**line["body"], "chat_template_kwargs": {"tools": []}}}), 3)
    bad = bulk_job(reserved, spec)
    assert isinstance(bad, BadLine) and "may not set 'tools'" in bad.reason


def test_the_engine_and_the_producer_reserve_the_same_template_arguments():
    from pagestream.engine.input_processor import RESERVED_TEMPLATE_ARGS as ENGINE
    from pagestream.producer.protocol.chat_template import RESERVED_TEMPLATE_ARGS as PRODUCER

    assert ENGINE == PRODUCER

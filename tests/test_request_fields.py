"""Issue 37: nothing accepted and ignored. Every field of the gateway's request models, set to a value
other than its default, either changes the jobs the request becomes (so the worker sees it), is refused
(a ``RequestError`` or ``ValidationError``: the gateway's 400), or is on the short list below of fields
whose effect is in the gateway's own answer, each with the test that shows it. A new field fails this
test until it is given a sample value and one of those three fates."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from pagestream.producer.gateway.protocol import ChatCompletionRequest, CompletionRequest
from pagestream.producer.protocol.errors import RequestError

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

#: a value other than the default for every field (both models)
SAMPLES = {
    "allowed_token_ids": [1, 2], "best_of": 2, "echo": True, "frequency_penalty": 0.5, "ignore_eos": True,
    "include_stop_str_in_output": True, "logit_bias": {"5": 1.0}, "max_tokens": 7, "min_p": 0.1, "min_tokens": 2,
    "model": "other-model", "n": 2, "presence_penalty": 0.5, "prompt_logprobs": 1, "repetition_penalty": 1.2,
    "response_format": {"type": "json_object"}, "return_token_ids": True, "return_tokens_as_token_ids": True,
    "seed": 3, "skip_special_tokens": False, "stop": ["x"], "stop_token_ids": [9], "stream": True,
    "stream_options": {"include_usage": True}, "structured_outputs": {"regex": "a+"}, "suffix": "s",
    "temperature": 0.3, "top_k": 5, "top_p": 0.5, "truncate_prompt_tokens": 1, "truncation_side": "right",
    "guided_json": {"type": "object"}, "guided_regex": "a", "guided_choice": ["a"], "guided_grammar": 'root ::= "a"',
    "guided_json_object": True, "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ",
    # chat
    "prompt": [[1, 2, 3]], "messages": [{"role": "user", "content": "other"}], "logprobs": True, "top_logprobs": 2,
    "max_completion_tokens": 5, "add_generation_prompt": False, "continue_final_message": True,
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"enable_thinking": False},
    "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False,
}

#: fields whose effect is in the gateway's answer rather than in the job, and where that is tested
GATEWAY_SIDE = {
    "stream": "SSE instead of one body (tests/test_gateway.py, test_gateway_streams.py)",
    "stream_options": "usage chunks in a stream (tests/test_gateway_vllm.py)",
    "return_tokens_as_token_ids": "logprobs name tokens as token_id:<int> (tests/test_gateway_vllm.py)",
    "echo": "the prompt leads the answer (tests/test_gateway_vllm.py, test_lm_eval.py)",
    "parallel_tool_calls": "at most one tool call parsed from the output (tests/test_tool_calls.py)",
}

#: fields that only qualify another one: they must change the jobs once that one is set
MODIFIERS = {
    "truncation_side": {"prompt": [1, 2, 3, 4], "truncate_prompt_tokens": 2},  # which end truncation keeps
}

BASES = {
    CompletionRequest: {"model": "m", "prompt": "hello"},
    ChatCompletionRequest: {"model": "m", "messages": [{"role": "user", "content": "hello"}]},
}


def _jobs(model, body: dict) -> list[dict]:
    req = model.model_validate(body)
    return [job.model_dump(mode="json", exclude={"job_id", "created_at"})  # created_at: the clock, not the field
            for job in req.to_jobs([f"j{i}" for i in range(req.num_jobs())])]


@pytest.mark.parametrize("model", list(BASES), ids=lambda m: m.__name__)
def test_every_request_field_has_an_effect_is_refused_or_is_answered_by_the_gateway(model):
    base = _jobs(model, BASES[model])
    assert _jobs(model, BASES[model]) == base  # the comparison itself is stable
    missing = sorted(set(model.model_fields) - set(SAMPLES))
    assert not missing, f"give these fields a sample value and a fate: {missing}"
    ignored = []
    for field in sorted(model.model_fields):
        body = {**BASES[model], field: SAMPLES[field]}
        try:
            jobs = _jobs(model, body)
        except (RequestError, ValidationError):
            continue  # refused: a 400 naming the field
        if jobs != base:
            continue  # the worker sees it
        if field in MODIFIERS:
            with_partner = {**BASES[model], **MODIFIERS[field]}
            if _jobs(model, {**with_partner, field: SAMPLES[field]}) != _jobs(model, with_partner):
                continue
        if field not in GATEWAY_SIDE:
            ignored.append(field)
    assert not ignored, f"accepted and ignored: {ignored}"

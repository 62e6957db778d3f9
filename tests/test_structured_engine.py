"""Structured outputs through the engine (issue 23, acceptance 1 and the engine half of 3): SmolLM2
on the CPU at temperature 1.0, five schemas of the kinds people send, 20 samples each in one
``LLM.generate``; regex and choice; a compile error ends the request with the compiler's message;
unconstrained neighbours are unaffected; preemption under KV pressure and a resume from tokens
generated elsewhere still finish conforming."""
from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from pagestream import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12}},
                 "required": ["id", "name"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                                        "items": {"type": "string", "maxLength": 8}}},
              "required": ["tags"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                 "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"}},
                "required": ["zip", "code"], "additionalProperties": False},
    "bounded_optional": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 65},
                                                          "score": {"type": "number"},
                                                          "nick": {"type": "string", "maxLength": 6}},
                         "required": ["age"], "additionalProperties": False},
}
SAMPLES = 20


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(model=smollm2_dir, max_model_len=512)


def _prompt(llm, text):
    return llm.llm_engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                        add_generation_prompt=True)


def test_five_schemas_twenty_samples_each_validate(llm):
    names = list(SCHEMAS)
    params = [SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=96, seed=k, output_kind="final",
                             structured_outputs=StructuredOutputsParams(json=SCHEMAS[name], disable_any_whitespace=True))
              for k, name in enumerate(names)]
    before = llm.llm_engine.stats().structured_compilations
    outs = llm.generate([_prompt(llm, f"Answer in JSON ({name}).") for name in names], params, use_tqdm=False)
    for name, out in zip(names, outs):
        assert out.error is None
        for c in out.outputs:
            assert c.finish_reason == "stop", (name, c.text)
            jsonschema.validate(json.loads(c.text), SCHEMAS[name])
    assert llm.llm_engine.stats().structured_compilations - before == len(names)


def test_regex_and_choice_match_in_full(llm):
    regex = r"[A-Z][a-z]{2,8}, [0-9]{1,2} (May|June)"
    outs = llm.generate([_prompt(llm, "A name and a date?")] * 2, [
        SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=32, structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=16,
                       structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe later"])),
    ], use_tqdm=False)
    for c in outs[0].outputs:
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
    for c in outs[1].outputs:
        assert c.finish_reason == "stop" and c.text in ("yes", "no", "maybe later"), c.text


def test_max_tokens_mid_structure_is_length_never_stop(llm):
    out = llm.generate([_prompt(llm, "JSON please")], SamplingParams(
        n=4, temperature=1.0, max_tokens=3, structured_outputs=StructuredOutputsParams(json=SCHEMAS["nested"])),
        use_tqdm=False)[0]
    assert [c.finish_reason for c in out.outputs] == ["length"] * 4


def test_a_grammar_that_cannot_compile_ends_its_request_with_the_reason(llm):
    outs = llm.generate([_prompt(llm, "x"), "Hello, my name is"], [
        SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(grammar='root ::= "a" |')),
        SamplingParams(temperature=0.0, max_tokens=8),
    ], use_tqdm=False)
    assert "EBNF parser error" in outs[0].error and outs[0].outputs[0].finish_reason == "abort"
    assert outs[1].error is None and outs[1].outputs[0].finish_reason == "length"


def test_unconstrained_neighbours_are_unaffected(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ["The capital of France is", "Once upon a time"]
    alone = [o.outputs[0].text for o in llm.generate(prompts, plain, use_tqdm=False)]
    constrained = SamplingParams(n=4, temperature=1.0, max_tokens=40,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMAS["enum"]))
    mixed = llm.generate([prompts[0], _prompt(llm, "json"), prompts[1]], [plain, constrained, plain], use_tqdm=False)
    assert [mixed[0].outputs[0].text, mixed[2].outputs[0].text] == alone


def test_resume_from_tokens_generated_elsewhere_still_conforms(llm):
    engine = llm.llm_engine
    tok = engine.tokenizer
    schema = SCHEMAS["pattern"]
    resume = tok.encode('{"zip": "12', add_special_tokens=False)
    params = SamplingParams(temperature=1.0, max_tokens=64, seed=3,
                            structured_outputs=StructuredOutputsParams(json=schema))
    engine.add_request("resumed", prompt=_prompt(llm, "A zip code as JSON"), params=params, resume_token_ids=resume)
    tokens = list(resume)
    finish = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
            finish = out.outputs[0].finish_reason or finish
    text = tok.decode(tokens, skip_special_tokens=True)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_preemption_under_kv_pressure_still_conforms(smollm2_dir):
    small = LLM(model=smollm2_dir, max_model_len=256, num_kv_blocks=24, block_size=16)
    schema = SCHEMAS["bounded_optional"]
    prompt = _prompt(small, "A person's age as JSON, with a nickname and score.")
    outs = small.generate([prompt] * 6, SamplingParams(n=2, temperature=1.0, max_tokens=48, seed=5,
                                                        structured_outputs=StructuredOutputsParams(json=schema)),
                          use_tqdm=False)
    assert small.llm_engine.stats().num_preemptions > 0
    for out in outs:
        for c in out.outputs:
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), schema)
    assert sum(c.finish_reason == "stop" for o in outs for c in o.outputs) >= 6


def test_the_engine_process_carries_constraints_and_compile_errors(smollm2_dir):
    """The worker's engine core runs in a process of its own: the constraint and a compile error cross it."""
    from pagestream.engine import EngineConfig
    from pagestream.engine.engine_process import EngineProcess

    ep = EngineProcess(EngineConfig(model=smollm2_dir, max_model_len=256))
    try:
        ep.add_request("bad", prompt="x", params=SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(a")))
        ep.add_request("good", prompt="Pick", params=SamplingParams(
            max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["red", "blue"])))
        text, fin = {"bad": "", "good": ""}, {}
        while len(fin) < 2:
            for o in ep.step():
                text[o.request_id] += o.outputs[0].text if o.outputs else ""
                if o.finished:
                    fin[o.request_id] = (o.error, o.outputs[0].finish_reason if o.outputs else None)
    finally:
        ep.shutdown() if hasattr(ep, "shutdown") else ep.close()
    assert "parenthesis is not closed" in fin["bad"][0]
    assert fin["good"] == (None, "stop") and text["good"] in ("red", "blue")


def _overlap_probe(engine):
    """Record, per launch, whether a step was still in flight unread (the launch overlapped it)."""
    launches = []
    execute = engine.runner.execute

    def probe(sched, prev=None):
        launches.append(prev is not None and prev.sampled is None)
        return execute(sched, prev)

    engine.runner.execute = probe
    return launches


def test_constrained_batches_keep_asynchronous_scheduling(smollm2_dir):
    """Only structured requests: step N+1 is launched before step N is read (its mask waits for N's
    tokens inside the launch, the forward pass already queued), and the outputs equal a synchronous
    run's with the same seeds, n=2 and an unconstrained neighbour included; every output validates."""
    names = ["enum", "array", "pattern", "nested"]
    runs = {}
    for async_scheduling in (True, False):
        llm = LLM(model=smollm2_dir, max_model_len=512, async_scheduling=async_scheduling)
        launches = _overlap_probe(llm.llm_engine)
        params = [SamplingParams(n=2, temperature=1.0, max_tokens=64, seed=k,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMAS[name], disable_any_whitespace=True))
                  for k, name in enumerate(names)]
        outs = llm.generate([_prompt(llm, f"Answer in JSON ({name}).") for name in names], params, use_tqdm=False)
        runs[async_scheduling] = ([[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs], launches)
        assert llm.llm_engine.stats().num_free_blocks == llm.llm_engine.stats().num_total_blocks
    (asyn, overlapped), (sync, waited) = runs[True], runs[False]
    assert not any(waited)
    assert len(overlapped) > 10 and all(overlapped[1:]), overlapped  # every launch after the first overlapped
    assert asyn == sync
    for name, out in zip(names, asyn):
        for _, text, finish in out:
            assert finish == "stop", (name, text)
            jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_an_abort_with_a_constrained_step_in_flight(smollm2_dir):
    """Aborting a constrained request while its step is on the device: it gets no more tokens, its
    neighbours (constrained and not) finish as they would, every block comes back."""
    llm = LLM(model=smollm2_dir, max_model_len=512)
    engine = llm.llm_engine
    schema = SCHEMAS["array"]
    constrained = SamplingParams(n=2, temperature=1.0, max_tokens=64, seed=1,
                                 structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    engine.add_request("a", prompt=_prompt(llm, "Tags as JSON"), params=constrained)
    engine.add_request("b", prompt=_prompt(llm, "More tags as JSON"), params=constrained)
    engine.add_request("c", prompt="Once upon a time", params=SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    texts, fin = {}, {}

    def take(outs):
        for o in outs:
            for c in o.outputs:
                texts[(o.request_id, c.index)] = texts.get((o.request_id, c.index), "") + c.text
            if o.finished:
                fin[o.request_id] = [c.finish_reason for c in o.outputs]

    while len(texts.get(("a", 0), "")) < 3:
        take(engine.step())
    assert engine.core.step_in_flight  # a step holding a token of "a" is on its way
    assert engine.abort_request("a")
    while engine.has_unfinished_requests():
        take(engine.step())
    assert fin["a"] == ["abort", "abort"]
    assert fin["b"] == ["stop", "stop"] and fin["c"] == ["length"]
    for i in range(2):
        jsonschema.validate(json.loads(texts[("b", i)]), schema)
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_tensor_parallel_masks_on_rank_zero(tiny_llama_dir):
    """At TP=2 only rank 0 samples, so only it masks (with the in-flight step's tokens): a seeded
    constrained request gives the same text as at TP=1, and the text matches its regex."""
    regex = r"[a-z]{3,6}-[0-9]{2,4}"
    params = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=7, structured_outputs=StructuredOutputsParams(regex=regex))
    prompts = ["code:", "another code:"]
    small = dict(device="cpu", num_kv_blocks=64, block_size=16, max_num_seqs=8)
    want = [[c.text for c in o.outputs] for o in LLM(tiny_llama_dir, **small).generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, **small)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.runner.shutdown()
    got = [[c.text for c in o.outputs] for o in outs]
    assert got == want
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text

"""A structured-output request's grammar work is bounded (issue 37, item 3): a 40-byte ambiguous grammar
makes xgrammar's matcher cost more per token as the output grows (cubically: ~3 ms a step by 50 x's,
300 ms by token 200), which slowed every request beside it 13x. Over ``grammar_step_limit_ms`` (one
sequence's work in one step) or ``grammar_request_limit_s`` (a request's work in all) the request ends
with an error naming the bound, as a grammar that cannot compile does; its neighbours run on as they
would without it. On a tiny random model (SmolLM2's tokenizer), at temperature 0."""
from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("xgrammar")

from pagestream import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

HOSTILE = 'root ::= a\na ::= a a a | a a | "x" | ""'
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "size"], "additionalProperties": False}


#: unbounded, the hostile request's 40th token costs ~0.1 s of matcher work and all 40 ~1 s (its tokens
#: hold 1 to 4 x's); the bounds below stop it within ~15 tokens, so a lost bound fails fast
HOSTILE_TOKENS = 40


def _hostile(**kwargs) -> SamplingParams:
    # min_tokens keeps EOS out (the empty string matches, so the grammar would allow it at once)
    return SamplingParams(temperature=0.0, min_tokens=HOSTILE_TOKENS, max_tokens=HOSTILE_TOKENS,
                          structured_outputs=StructuredOutputsParams(grammar=HOSTILE), **kwargs)


NEIGHBOURS = [
    ("The capital of France is", SamplingParams(temperature=0.0, max_tokens=24)),
    ("Answer in JSON.", SamplingParams(temperature=0.0, max_tokens=24,
                                       structured_outputs=StructuredOutputsParams(json=SCHEMA))),
    ("Pick one.", SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=8,
                                 structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe later"]))),
    ("Once upon a time", SamplingParams(temperature=1.0, seed=5, max_tokens=24)),
]


def _samples(outs):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


def _all_blocks_free(llm) -> bool:
    # (a step may still be in flight: the token it sampled for the ended request is dropped when read)
    stats = llm.llm_engine.stats()
    return stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0


@pytest.mark.parametrize("async_scheduling", [True, False])  # the matcher takes tokens in the launch / the read
def test_a_grammar_over_the_step_limit_ends_with_the_reason_and_spares_its_neighbours(tiny_llama_dir, async_scheduling):
    llm = LLM(model=tiny_llama_dir, max_model_len=512, grammar_step_limit_ms=3, async_scheduling=async_scheduling)
    assert llm.llm_engine.structured_outputs.step_budget_s == pytest.approx(0.003)
    prompts, params = [p for p, _ in NEIGHBOURS], [s for _, s in NEIGHBOURS]
    alone = _samples(llm.generate(prompts, params, use_tqdm=False))
    mixed = llm.generate(["x", *prompts], [_hostile(), *params], use_tqdm=False)
    hostile = mixed[0]
    assert re.fullmatch(r"structured output grammar took \d+ ms in one step \(limit 3 ms\): "
                        r"the constraint is too costly to follow", hostile.error or ""), hostile.error
    assert hostile.outputs[0].finish_reason == "abort"
    # it ended before its min_tokens, and what it produced conforms
    assert 0 < len(hostile.outputs[0].token_ids) < HOSTILE_TOKENS and set(hostile.outputs[0].text) == {"x"}
    assert all(o.error is None for o in mixed[1:])
    assert _samples(mixed[1:]) == alone
    assert _all_blocks_free(llm)
    stats = llm.llm_engine.structured_outputs.stats()
    assert stats["structured_budget_errors"] == 1 and not llm.llm_engine.structured_outputs.over_budget


def test_a_grammar_over_the_request_limit_ends_with_the_reason(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, max_model_len=512, grammar_request_limit_s=0.05)
    manager = llm.llm_engine.structured_outputs
    assert (manager.step_budget_s, manager.request_budget_s) == (pytest.approx(0.05), 0.05)  # the step's default
    outs = llm.generate(["x", "The capital of France is"],
                        [_hostile(), SamplingParams(temperature=0.0, max_tokens=16)], use_tqdm=False)
    assert re.fullmatch(r"structured output grammar took \d+\.\d s in all \(limit 0\.05 s\): "
                        r"the constraint is too costly to follow", outs[0].error or ""), outs[0].error
    assert outs[0].outputs[0].finish_reason == "abort" and len(outs[0].outputs[0].token_ids) < HOSTILE_TOKENS
    assert outs[1].error is None and outs[1].outputs[0].finish_reason == "length"
    assert _all_blocks_free(llm)


def test_an_over_budget_request_ends_through_the_engine_process_too(tiny_llama_dir):
    """The worker's core runs in a process of its own: the knob reaches it and the error crosses back."""
    from pagestream.engine import EngineConfig
    from pagestream.engine.engine_process import EngineProcess

    ep = EngineProcess(EngineConfig(model=tiny_llama_dir, max_model_len=512, grammar_step_limit_ms=3))
    try:
        ep.add_request("hostile", prompt="x", params=_hostile())
        ep.add_request("good", prompt="Pick", params=SamplingParams(
            max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["red", "blue"])))
        fin = {}
        while len(fin) < 2:
            for o in ep.step():
                if o.finished:
                    fin[o.request_id] = (o.error, o.outputs[0].finish_reason if o.outputs else None)
    finally:
        ep.close()
    assert "(limit 3 ms)" in fin["hostile"][0] and fin["hostile"][1] == "abort"
    assert fin["good"] == (None, "stop")


def test_json_schema_requests_are_never_stopped_at_the_default_limits(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, max_model_len=512)
    manager = llm.llm_engine.structured_outputs
    assert (manager.step_budget_s, manager.request_budget_s) == (pytest.approx(0.05), 10.0)
    schemas = [SCHEMA, {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                                         "note": {"type": "string"}},
                        "required": ["tags", "note"]}]
    prompts = ["Answer in JSON.", "A color and a size?", "Tags and a note, please.", "{"]
    outs = llm.generate(prompts * 2, [
        SamplingParams(temperature=0.0, max_tokens=160, structured_outputs=StructuredOutputsParams(json=s))
        for s in schemas for _ in prompts], use_tqdm=False)
    for out in outs:
        assert out.error is None
        assert all(c.finish_reason in ("stop", "length") and c.token_ids for c in out.outputs)
    stats = manager.stats()
    assert stats["structured_grammar_s"] > 0 and stats["structured_budget_errors"] == 0  # measured, never over
    assert _all_blocks_free(llm)


def test_the_limits_are_checked(tiny_llama_dir):
    from pagestream.engine import EngineConfig

    for bad in ({"grammar_step_limit_ms": -1}, {"grammar_request_limit_s": float("nan")}):
        with pytest.raises(ValueError, match="must be a number >= 0"):
            EngineConfig(model=tiny_llama_dir, **bad)
    EngineConfig(model=tiny_llama_dir, grammar_step_limit_ms=0, grammar_request_limit_s=0)  # 0: no limit


EXIT_AT_ONCE = r"""
import atexit, sys
from pagestream import LLM
llm = LLM(sys.argv[1], device="cpu", num_kv_blocks=16)
warm = llm.llm_engine.core.grammar_warm_up
# atexit runs after the interpreter has waited for its non-daemon threads and before C++ statics go
atexit.register(lambda: print("warm-up alive at exit:", warm is not None and warm.is_alive(), flush=True))
"""


def test_a_script_that_builds_an_engine_and_exits_at_once_exits_cleanly(tiny_llama_dir):
    # The grammar warm-up thread (xgrammar's import and tokenizer table, ~0.5 s) was a daemon: a script that
    # exited while it ran could die of SIGABRT ("terminate called without an active exception") after its
    # work was done, as CI's offline hub-id script did. The process now waits for it.
    import subprocess
    import sys

    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", EXIT_AT_ONCE, tiny_llama_dir], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "terminate called" not in proc.stderr
        assert "warm-up alive at exit: False" in proc.stdout, proc.stdout

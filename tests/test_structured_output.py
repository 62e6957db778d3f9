"""Structured outputs in the engine's own parts (issue 23, phase 1): the params' checks, the
xgrammar backend's compile cache and errors, the per-sequence matcher and the bitmask on the
logits, on SmolLM2's real tokenizer; and SmolLM2 itself sampling at temperature 1.0 through the
mask (HF transformers' generate drives the model, our manager builds and applies the mask)."""
from __future__ import annotations

import json
import re
import threading

import pytest

torch = pytest.importorskip("torch")
xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from pagestream import SamplingParams, StructuredOutputsParams  # noqa: E402
from pagestream.engine.structured_output import (  # noqa: E402
    StructuredOutputError,
    StructuredOutputManager,
    XgrammarBackend,
    allocate_bitmask,
    apply_bitmask,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "nickname": {"type": "string", "maxLength": 8},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def vocab_size(smollm2_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(smollm2_dir).vocab_size


@pytest.fixture()
def backend(tokenizer, vocab_size):
    b = XgrammarBackend(tokenizer, vocab_size, max_threads=2)
    yield b
    b.shutdown()


def _allowed(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    bits = bitmask[row].view(torch.uint8).numpy()
    import numpy as np

    flags = np.unpackbits(bits, bitorder="little")[:vocab]
    return set(np.nonzero(flags)[0].tolist())


# ---- params ----------------------------------------------------------------------------------------


def test_params_take_exactly_one_kind():
    with pytest.raises(ValueError, match="none was given"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got 2: json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(ValueError, match="whitespace_pattern is not supported"):
        StructuredOutputsParams(json_object=True, whitespace_pattern=r"\s*")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['guided_json'\]"):
        StructuredOutputsParams.from_dict({"guided_json": {}})
    assert StructuredOutputsParams(choice=["a", "b"]).kind == "choice"


def test_cache_key_ignores_key_order_and_json_spelling():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}')
    assert a.key() == b.key()
    assert a.key() != StructuredOutputsParams(json=a.json, disable_any_whitespace=True).key()
    closed = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "object"}}},
                                     disable_additional_properties=True).json_schema()
    assert closed["additionalProperties"] is False and closed["properties"]["x"]["additionalProperties"] is False


def test_sampling_params_take_a_dict_as_the_queue_sends_it():
    p = SamplingParams(structured_outputs={"regex": "[0-9]{3}"})
    assert p.structured_outputs == StructuredOutputsParams(regex="[0-9]{3}")
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs="json")
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={})


# ---- backend ---------------------------------------------------------------------------------------


def test_one_schema_compiles_once_and_is_a_cache_hit_after(backend):
    reordered = json.loads(json.dumps(PERSON))
    reordered = dict(reversed(list(reordered.items())))
    backend.compile(StructuredOutputsParams(json=PERSON))
    for _ in range(5):
        backend.compile(StructuredOutputsParams(json=reordered))
    assert (backend.stats.compilations, backend.stats.cache_hits) == (1, 5)
    backend.compile(StructuredOutputsParams(json=PERSON, disable_any_whitespace=True))
    assert backend.stats.compilations == 2


@pytest.mark.parametrize("params, reason", [
    (StructuredOutputsParams(json={"type": "nope"}), 'invalid json for structured outputs: Unsupported type "nope"'),
    (StructuredOutputsParams(regex="[a-"), "invalid regex for structured outputs: Regex parsing error at position 4: Unclosed '['"),
    (StructuredOutputsParams(regex="(?=x)a"), "Lookahead is not supported"),
    (StructuredOutputsParams(grammar='root ::= "a" | '), "invalid grammar for structured outputs: EBNF parser error at line 1"),
    (StructuredOutputsParams(grammar="start: ??"), "not EBNF"),
])
def test_a_constraint_that_cannot_compile_says_why(backend, params, reason):
    with pytest.raises(StructuredOutputError) as err:
        backend.compile(params)
    assert reason in str(err.value)
    assert "/project/cpp" not in str(err.value)
    assert backend.stats.compile_errors == 1
    with pytest.raises(StructuredOutputError):  # a failed compile is not cached as a success
        backend.compile(params)


def test_ebnf_and_lark_grammars_both_compile(backend):
    backend.compile(StructuredOutputsParams(grammar='root ::= "yes" | "no"'))
    backend.compile(StructuredOutputsParams(grammar='start: "yes" | "no"'))
    assert backend.stats.compilations == 2


def test_manager_waits_without_blocking_and_times_out(tokenizer, vocab_size, monkeypatch):
    manager = StructuredOutputManager(tokenizer, vocab_size, max_threads=1, compile_timeout_s=0.3)
    release = threading.Event()
    real = manager.backend._compile
    monkeypatch.setattr(manager.backend, "_compile", lambda p: (release.wait(5), real(p))[1])
    manager.add_request("slow", StructuredOutputsParams(regex="a+"))
    assert manager.is_ready("slow") is False  # returns at once while the pool compiles
    import time

    time.sleep(0.35)
    with pytest.raises(StructuredOutputError, match="did not compile within 0.3 s"):
        manager.is_ready("slow")
    release.set()
    manager.add_request("bad", StructuredOutputsParams(regex="(a"))
    import concurrent.futures

    concurrent.futures.wait([manager._pending["bad"].future])
    with pytest.raises(StructuredOutputError, match="regex"):
        manager.is_ready("bad")
    manager.shutdown()


# ---- matcher and mask ------------------------------------------------------------------------------


def test_choice_mask_allows_only_the_choices_and_eos_only_at_the_end(tokenizer, vocab_size):
    manager = StructuredOutputManager(tokenizer, vocab_size, max_threads=1)
    manager.add_request("r", StructuredOutputsParams(choice=["yes", "no"]))
    import concurrent.futures

    concurrent.futures.wait([manager._pending["r"].future])
    assert manager.is_ready("r")
    g = manager.grammar("r-0", "r")
    bitmask, rows = manager.fill_bitmask([None, g])
    assert rows == [1]
    eos = tokenizer.eos_token_id
    first = _allowed(bitmask, 1, vocab_size)
    assert eos not in first
    assert all("yes".startswith(tokenizer.decode([t])) or "no".startswith(tokenizer.decode([t])) for t in first)
    assert len(_allowed(bitmask, 0, vocab_size)) == vocab_size  # the unconstrained row is untouched
    ids = tokenizer.encode("yes")
    assert g.accept_tokens(ids) and g.is_completed() and not g.is_terminated()
    bitmask, _ = manager.fill_bitmask([g])
    assert _allowed(bitmask, 0, vocab_size) == {eos}
    assert g.accept_tokens([eos]) and g.is_terminated()
    assert not g.accept_tokens([ids[0]])  # nothing after termination
    manager.shutdown()


def test_advance_to_rebuilds_the_state_a_resume_or_preemption_needs(backend, tokenizer, vocab_size):
    from pagestream.engine.structured_output import StructuredOutputGrammar

    compiled = backend.compile(StructuredOutputsParams(json=PERSON))
    text = '{"name": "Ada", "age": 36, "role": "admin", "tags": ["x"'
    ids = tokenizer.encode(text)
    walked = StructuredOutputGrammar(backend.matcher(compiled), vocab_size)
    assert walked.accept_tokens(ids[:5])
    assert walked.advance_to(ids[:3] + ids[3:])  # the same tokens: a no-op
    other = tokenizer.encode('{"name": "Bob"')
    assert walked.advance_to(other) and walked.accepted == other  # rolled back to the common prefix
    assert walked.advance_to(ids)
    fresh = StructuredOutputGrammar(backend.matcher(compiled), vocab_size)
    assert fresh.accept_tokens(ids)
    a, b = allocate_bitmask(1, vocab_size), allocate_bitmask(1, vocab_size)
    walked.fill_bitmask(a, 0)
    fresh.fill_bitmask(b, 0)
    assert torch.equal(a, b)
    bad = StructuredOutputGrammar(backend.matcher(compiled), vocab_size)
    assert not bad.advance_to(tokenizer.encode("Sure! Here is"))  # output that never conformed


def test_bitmask_on_padded_logits_touches_only_constrained_rows(tokenizer, vocab_size):
    padded = vocab_size + 64  # an LM head rounded up past the tokenizer
    backend = XgrammarBackend(tokenizer, padded, max_threads=1)
    compiled = backend.compile(StructuredOutputsParams(regex="[0-9]+"))
    from pagestream.engine.structured_output import StructuredOutputGrammar

    g = StructuredOutputGrammar(backend.matcher(compiled), padded)
    bitmask = allocate_bitmask(3, padded)
    g.fill_bitmask(bitmask, 2)
    logits = torch.randn(3, padded + 32)  # wider still: the runner's buffer
    before = logits.clone()
    apply_bitmask(logits, bitmask, [2], padded)
    assert torch.equal(logits[:2], before[:2])
    allowed = torch.isfinite(logits[2]).nonzero()[:, 0].tolist()
    assert allowed and all(re.fullmatch("[0-9]+", tokenizer.decode([t])) for t in allowed)
    assert max(allowed) < vocab_size  # no pad id, no id past the grammar's vocabulary
    for t in allowed:
        assert logits[2, t] == before[2, t]
    with pytest.raises(ValueError, match="row for row"):
        apply_bitmask(logits[:2], bitmask, [1], padded)
    backend.shutdown()


# ---- SmolLM2 sampling through the mask -------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)


class _MaskProcessor:
    """A transformers logits processor that asks our manager for each step's mask."""

    def __init__(self, manager, grammars, prompt_len):
        self.manager, self.grammars, self.prompt_len = manager, grammars, prompt_len

    def __call__(self, input_ids, scores):
        for g, row in zip(self.grammars, input_ids.tolist()):
            out = row[self.prompt_len:]
            if not g.is_terminated() and g.num_processed_tokens < len(out):  # HF pads a finished row with EOS
                assert g.accept_tokens(out[g.num_processed_tokens:]), "a sampled token broke the grammar"
        rows = [None if g.is_terminated() else g for g in self.grammars]
        bitmask, constrained = self.manager.fill_bitmask(rows)
        apply_bitmask(scores, bitmask, constrained, self.manager.vocab_size)
        return scores


@pytest.mark.parametrize("params, check", [
    (StructuredOutputsParams(json=PERSON), lambda text: jsonschema.validate(json.loads(text), PERSON)),
    (StructuredOutputsParams(json_object=True), lambda text: isinstance(json.loads(text), dict) or 1 / 0),
    (StructuredOutputsParams(regex=r"[A-Z][a-z]{1,10} \d{2,3}"), lambda text: re.fullmatch(r"[A-Z][a-z]{1,10} \d{2,3}", text) or 1 / 0),
    (StructuredOutputsParams(choice=["red", "green", "blue"]), lambda text: text in ("red", "green", "blue") or 1 / 0),
])
def test_smollm2_at_temperature_one_conforms(hf_model, tokenizer, vocab_size, params, check):
    from transformers import LogitsProcessorList

    model = hf_model
    manager = StructuredOutputManager(tokenizer, vocab_size, stop_token_ids=[tokenizer.eos_token_id], max_threads=1)
    manager.add_request("r", params)
    manager.backend.result(manager._pending["r"].future)
    assert manager.is_ready("r")
    num = 3
    grammars = [manager.grammar(f"r-{i}", "r") for i in range(num)]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}],
                                           tokenize=False, add_generation_prompt=True)
    inputs = tokenizer([prompt] * num, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**inputs, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=80,
                         logits_processor=LogitsProcessorList([_MaskProcessor(manager, grammars, inputs.input_ids.shape[1])]),
                         pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    finished = 0
    for row, g in zip(out[:, inputs.input_ids.shape[1]:].tolist(), grammars):
        if tokenizer.eos_token_id not in row:  # any JSON object may run long at temperature 1.0
            assert params.json_object and not g.is_completed()
            continue
        finished += 1
        # the processor sees no step after the last token: the matcher takes the EOS here
        assert g.advance_to(row[: row.index(tokenizer.eos_token_id) + 1]) and g.is_terminated()
        text = tokenizer.decode(row[: row.index(tokenizer.eos_token_id)])
        check(text)
    assert finished >= (1 if params.json_object else num)
    assert manager.stats()["structured_compilations"] == 1
    manager.shutdown()


# ---- the sampler applies the mask before every other step ------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.0},
    {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 7},
    {"temperature": 1.3, "min_p": 0.05, "repetition_penalty": 1.2, "logprobs": 2},
])
def test_sampler_draws_only_allowed_tokens_and_leaves_other_rows_alone(tokenizer, vocab_size, kwargs):
    from pagestream.engine.sampler import Sampler
    from pagestream.engine.sequence import Sequence
    from pagestream.engine.structured_output import StructuredOutputGrammar

    backend = XgrammarBackend(tokenizer, vocab_size, max_threads=1)
    g = StructuredOutputGrammar(backend.matcher(backend.compile(StructuredOutputsParams(regex="[0-9]{2}"))), vocab_size)
    params = SamplingParams(**kwargs)
    seqs = [Sequence(f"s{i}", f"r{i}", 0, [1, 2, 3], 3, params, i) for i in range(4)]
    bitmask = allocate_bitmask(4, vocab_size)
    g.fill_bitmask(bitmask, 1)
    g.fill_bitmask(bitmask, 3)
    sampler = Sampler(vocab_size, {tokenizer.eos_token_id}, seed=0, device=torch.device("cpu"))
    torch.manual_seed(1)
    logits = torch.randn(4, vocab_size) * 5
    plain = sampler(logits.clone(), seqs).token_ids.tolist()
    out = sampler(logits.clone(), seqs, (bitmask, [1, 3]))
    tokens = out.token_ids.tolist()
    for row in (1, 3):
        assert re.fullmatch("[0-9]{1,2}", tokenizer.decode([tokens[row]])), tokens[row]
    if params.greedy or params.seed is not None:  # rows without a constraint draw what they drew before
        assert [tokens[0], tokens[2]] == [plain[0], plain[2]]
    if params.logprobs:  # the model's own distribution, before the mask
        lp = torch.log_softmax(logits[1], dim=-1)[tokens[1]].item()
        assert out.chosen[1].item() == pytest.approx(lp, abs=1e-4)
    backend.shutdown()

"""The one parser for JSON that crosses a trust boundary (lane entries, bulk lines)."""
import json

import pytest

from pagestream.producer.protocol.wire import UntrustedJSONError, loads_untrusted


def test_accepts_ordinary_json_and_unicode():
    doc = {"prompt": "héllo 🌍", "metadata": {"tags": ["a", 1, 2.5, None, True]}}
    assert loads_untrusted(json.dumps(doc, ensure_ascii=False).encode(), max_bytes=1000) == doc
    assert loads_untrusted(json.dumps(doc), max_bytes=1000) == doc


@pytest.mark.parametrize("raw, reason", [
    (b'{"metadata": {"k": "\\ud800"}}', "lone surrogate"),
    (b'{"\\udfff": 1}', "lone surrogate"),
    (b"[" * 200_000, "nested deeper"),
    (b'{"a": ' * 40 + b"1" + b"}" * 40, "nested deeper"),
    (b'{"x": NaN}', "NaN"),
    (b'{"x": -Infinity}', "Infinity"),
    (b"\xff\xfe{}", "UTF-8"),
    (b'{"a": 1', "not valid JSON"),
    (b'"' + b"x" * 300_000 + b'"', "bytes"),
    (b'{"t": 1e400}', "out of range"),
    (b'{"n": ' + b"9" * 5000 + b"}", "not valid JSON"),
])
def test_refuses_what_cannot_round_trip_or_is_too_big(raw, reason):
    with pytest.raises(UntrustedJSONError, match=reason):
        loads_untrusted(raw, max_bytes=256 * 1024)


def test_what_it_returns_always_serializes_back():
    value = loads_untrusted('{"a": ["\\u00e9", {"b": "\\ud83c\\udf0d"}]}', max_bytes=100)
    assert json.dumps(value, ensure_ascii=False).encode("utf-8")  # a surrogate *pair* is one real character
    assert value["a"][1]["b"] == "🌍"


def test_token_events_carry_logprobs_compactly_and_are_unchanged_without_them():
    from pagestream.producer.protocol.schema import JobResult, SampleResult, TokenLogprob
    from pagestream.producer.protocol.wire import decode_out_entry, token_event_fields

    # the layout every subscriber of an earlier release reads: no new key unless logprobs were asked for
    assert token_event_fields(0, 3, [5, 6], "ab", "stop") == {"type": "tok", "ev": '{"s":0,"i":3,"t":[5,6],"x":"ab","f":"stop"}'}
    lps = [[5, "a", -0.25, [[5, "a", -0.25], [7, "ü", -1.5]]], [6, "b", -0.125, []]]
    fields = token_event_fields(1, 3, [5, 6], "ab", None, lps)
    assert fields["ev"] == '{"s":1,"i":3,"t":[5,6],"x":"ab","l":[[5,"a",-0.25,[[5,"a",-0.25],[7,"ü",-1.5]]],[6,"b",-0.125,[]]]}'
    ev = decode_out_entry("j", {k.encode(): v.encode() for k, v in fields.items()})
    assert ev.logprobs[0].top_logprobs[1].token == "ü" and ev.logprobs[1].logprob == -0.125
    assert [lp.model_dump() for lp in ev.logprobs] == lps  # the typed model writes the same compact form back
    done = JobResult(job_id="j", status="completed", outputs=[SampleResult(index=0, text="ab", token_ids=[5, 6], logprobs=ev.logprobs)])
    res = JobResult.model_validate_json(done.model_dump_json())
    assert res.logprobs == res.outputs[0].logprobs == ev.logprobs
    assert done.model_dump_json().count('"ü"') == 1  # sample 0's logprobs are stored once, not again at the top
    # dicts work too (a caller building them by hand); a short list says what it expected
    assert TokenLogprob.model_validate({"token_id": 1, "token": "x", "logprob": -1.0}).top_logprobs == []
    with pytest.raises(ValueError, match="expected \\[token_id, token, logprob, top_logprobs\\]"):
        TokenLogprob.model_validate([1, "x"])


def test_prompt_logprobs_cross_the_wire_and_become_vllms_and_openais_shapes():
    from pagestream.producer.protocol.openai import completion_logprobs, text_completion_body
    from pagestream.producer.protocol.schema import JobResult, JobStatus
    from pagestream.worker.logprobs import TokenTexts

    class Tok:
        def decode(self, ids):
            return "".join(f"<{i}>" for i in ids)

    wire = TokenTexts(Tok()).encode_prompt([5, 7, 9], [None, {7: -1.5, 3: -0.5}, {9: -0.25, 3: -2.0}], 1)
    result = JobResult.model_validate_json(JobResult(job_id="j", status=JobStatus.COMPLETED, text="x",
                                                     prompt_logprobs=wire).model_dump_json())
    first, second, third = result.prompt_logprobs
    assert (first.token_id, first.token, first.logprob, first.top_logprobs) == (5, "<5>", None, [])
    assert (second.logprob, [(a.token_id, a.logprob) for a in second.top_logprobs]) == (-1.5, [(3, -0.5)])
    body = text_completion_body("cmpl-j", "m", 0, result)
    assert body["choices"][0]["prompt_logprobs"] == [
        None,
        {"3": {"logprob": -0.5, "rank": 1, "decoded_token": "<3>"}, "7": {"logprob": -1.5, "rank": None, "decoded_token": "<7>"}},
        {"9": {"logprob": -0.25, "rank": 1, "decoded_token": "<9>"}},
    ]
    echo = completion_logprobs(result.prompt_logprobs)
    assert echo == {"tokens": ["<5>", "<7>", "<9>"], "token_logprobs": [None, -1.5, -0.25],
                    "top_logprobs": [None, {"<7>": -1.5, "<3>": -0.5}, {"<9>": -0.25}], "text_offset": [0, 3, 6]}


def test_a_completed_jobs_end_entry_carries_its_usage_and_timings_and_an_older_one_reads_as_none():
    from pagestream.producer.protocol.schema import JobResult, SampleResult
    from pagestream.producer.protocol.wire import decode_out_entry, end_fields, end_summary
    done = JobResult(job_id="j", status="completed", prompt_tokens=7, completion_tokens=5, num_cached_tokens=3,
                     created_at=10.0, started_at=11.5, finished_at=12.25,
                     outputs=[SampleResult(index=0, text="abc", token_ids=[1, 2], finish_reason="length"),
                              SampleResult(index=1, text="d", token_ids=[3], finish_reason="stop")])
    raw = {k.encode(): v.encode() for k, v in end_fields("completed", done).items()}  # as Redis returns them
    assert decode_out_entry("j", raw) == "completed"  # what every reader of the status reads, unchanged
    got = end_summary("j", raw)
    assert (got.prompt_tokens, got.completion_tokens, got.num_cached_tokens) == (7, 5, 3)
    assert (got.created_at, got.started_at, got.finished_at) == (10.0, 11.5, 12.25)
    assert [s.finish_reason for s in got.outputs] == ["length", "stop"] and got.finish_reason == "length"
    # an older worker's entry, a job that did not complete, and a summary that is not ours: none (the result is read)
    assert end_summary("j", {b"type": b"end", b"status": b"completed"}) is None
    failed = done.model_copy(update={"status": "failed"})
    assert "u" not in end_fields("failed", failed) and end_summary("j", end_fields("failed", failed)) is None
    assert end_summary("j", {b"type": b"end", b"status": b"completed", b"u": b"{\"pt\": 1}"}) is None

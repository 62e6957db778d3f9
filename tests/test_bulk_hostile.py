"""Hostile bulk input lines (issue 8, items 4 and 7 on the bulk side), against the real Redis and moto.

A nesting bomb, lone surrogates, NaN, a line of tens of MiB or a line over a job limit
each become one error line with its line number and reason; the lines around them
complete, and the bulk ends ``completed`` with one output line per custom_id.
"""
from __future__ import annotations

import json
import tracemalloc

from pagestream.producer.bulk.api import submit_bulk
from pagestream.producer.bulk.io import max_line_bytes
from pagestream.producer.bulk.storage import split_lines
from pagestream.producer.protocol.limits import JobLimits
from test_bulk import bucket, read_jsonl, run_bulk_with_standins, s3  # noqa: F401 (fixtures)

HUGE_LINE_BYTES = 20 * 1024 * 1024


def _hostile_input(path) -> tuple[dict[int, str], set[str]]:
    """Good lines around hostile ones. Returns {hostile line number: words its error must hold}, good custom_ids."""
    lim = JobLimits()
    hostile = [
        (b"[" * 200_000, "nested deeper"),
        (b'{"custom_id": "bomb-obj", "prompt": "x", "metadata": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001, "nested deeper"),
        (b'{"custom_id": "sur", "prompt": "\\ud800 lone"}', "lone surrogate"),
        (b'{"custom_id": "sur-key", "prompt": "ok", "\\udfff": 1}', "lone surrogate"),
        (b'{"custom_id": "nan", "prompt": "x", "temperature": NaN}', "NaN"),
        (b'{"custom_id": "huge", "prompt": "' + b"h" * HUGE_LINE_BYTES + b'"}', "longer than"),
        (json.dumps({"custom_id": "big-prompt", "prompt": "p" * (lim.max_prompt_bytes + 1)}).encode(),
         "PAGESTREAM_MAX_PROMPT_BYTES"),
        (json.dumps({"custom_id": "stops", "prompt": "x", "stop": ["s"] * 200_000}).encode(),
         "PAGESTREAM_MAX_STOP_STRINGS"),
        (json.dumps({"custom_id": "tokens", "method": "POST", "url": "/v1/completions",
                     "body": {"prompt": "x", "max_tokens": 10**12}}).encode(), "PAGESTREAM_MAX_TOKENS"),
        (b"\xff\xfe\x00garbage", "not UTF-8"),
    ]
    reasons: dict[int, str] = {}
    good: set[str] = set()
    with open(path, "wb") as f:
        n = 0
        for raw, words in hostile:
            for _ in range(3):
                n += 1
                f.write(json.dumps({"custom_id": f"ok-{n}", "prompt": f"fine {n}", "max_tokens": 3}).encode() + b"\n")
                good.add(f"ok-{n}")
            n += 1
            f.write(raw + b"\n")
            reasons[n] = words
        n += 1
        f.write(json.dumps({"custom_id": "last", "prompt": "the end"}).encode())  # no trailing newline
        good.add("last")
    return reasons, good


def _check_output(read, manifest: dict, reasons: dict[int, str], good: set[str]) -> None:
    assert manifest["request_counts"] == {"total": len(reasons) + len(good), "completed": len(good),
                                          "failed": len(reasons)}
    out = [rec for shard in manifest["output_shards"] for rec in read_jsonl(read(shard["name"]))]
    assert sorted(r["custom_id"] for r in out) == sorted(good)  # one line per custom_id
    errors = [rec for shard in manifest["error_shards"] for rec in read_jsonl(read(shard["name"]))]
    assert [e["error"]["line"] for e in errors] == sorted(reasons)
    for e in errors:
        assert reasons[e["error"]["line"]] in e["error"]["message"], e
        assert len(json.dumps(e)) < 4096  # a reason quotes the input, never all of it


def test_hostile_lines_in_a_local_input_are_error_lines_and_the_bulk_completes(redis_url, tmp_path):
    inp = tmp_path / "in.jsonl"
    reasons, good = _hostile_input(inp)
    out = tmp_path / "out"
    bulk_id = submit_bulk(str(inp), str(out), redis_url=redis_url, max_outstanding=8)
    st = run_bulk_with_standins(redis_url, bulk_id, n_workers=1)
    assert st["status"] == "completed", st
    _check_output(lambda name: (out / name).read_bytes(), json.loads((out / "manifest.json").read_text()),
                  reasons, good)


def test_hostile_lines_in_an_s3_input_are_error_lines_and_the_bulk_completes(redis_url, s3, bucket, tmp_path):
    inp = tmp_path / "in.jsonl"
    reasons, good = _hostile_input(inp)
    s3.upload_file(str(inp), bucket, "in.jsonl")
    bulk_id = submit_bulk(f"s3://{bucket}/in.jsonl", f"s3://{bucket}/out", redis_url=redis_url, max_outstanding=8)
    st = run_bulk_with_standins(redis_url, bulk_id, n_workers=1)
    assert st["status"] == "completed", st

    def read(name: str) -> bytes:
        return s3.get_object(Bucket=bucket, Key=f"out/{name}")["Body"].read()

    _check_output(read, json.loads(read("manifest.json")), reasons, good)


def test_an_endless_line_is_read_in_bounded_memory():
    """A 512 MiB line with no newline: the reader keeps at most the limit + one chunk."""
    chunk = b"y" * (1024 * 1024)
    limit = 2 * 1024 * 1024
    tracemalloc.start()
    try:
        lines = list(split_lines(iter([b"first\n", *[chunk] * 512, b"\nlast"]), 0, max_line_bytes=limit))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(len(line), end) for line, end in lines] == [(5, 6), (limit + 1, 6 + 512 * len(chunk) + 1),
                                                         (4, 6 + 512 * len(chunk) + 5)]
    assert peak < 3 * limit, peak
    assert max_line_bytes() == JobLimits().max_entry_bytes

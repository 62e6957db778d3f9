"""The one parser for JSON that crosses a trust boundary (lane entries, bulk lines)."""
import json

import pytest

from pagestream.producer.wire import UntrustedJSONError, loads_untrusted


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

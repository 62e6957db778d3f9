"""The tool-call parsers (issue 26) on recorded outputs of each format: the whole text's calls, and the
same text streamed split at every position (and a character at a time) adding up to exactly that."""
from __future__ import annotations

import json

import pytest

from pagestream.producer.protocol.tool_parsers import (TOOL_PARSERS, NamedToolParser, RequiredToolParser, ToolParser,
                                                       merge_deltas)

WEATHER = '{"location": "San Francisco, CA", "unit": "fahrenheit"}'

# outputs as the models write them (Qwen2.5-7B-Instruct / Hermes-2-Pro, Llama-3.1-8B-Instruct, Mistral-7B-Instruct-v0.3
# and the v11 tokenizer's form), with the calls each holds
RECORDED = {
    "hermes": [
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>', None,
         [("get_weather", WEATHER)]),
        ('Let me check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris", "fmt": "a \\"quoted\\" }"}}\n'
         '</tool_call>', "Let me check both cities.\n",
         [("get_weather", '{"location": "Paris"}'), ("get_time", '{"tz": "Europe/Paris", "fmt": "a \\"quoted\\" }"}')]),
        ('<tool_call>\n{"arguments": {"q": [1, 2, {"x": null}]}, "name": "search"}\n</tool_call>', None,
         [("search", '{"q": [1, 2, {"x": null}]}')]),
        ('<tool_call>\n{"name": "list_files"}\n</tool_call>', None, [("list_files", "{}")]),
        ("The weather in Paris is sunny, 22 °C. 2 < 3 and <b>bold</b>.",
         "The weather in Paris is sunny, 22 °C. 2 < 3 and <b>bold</b>.", []),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"location": \n</tool_call>',
         '<tool_call>\n{"name": "get_weather", "arguments": {"location": \n</tool_call>', None),  # malformed: text
    ],
    "llama3_json": [
        (f'{{"name": "get_weather", "parameters": {WEATHER}}}', None, [("get_weather", WEATHER)]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"location": "Paris"}}; '
         '{"name": "get_time", "parameters": {"tz": "CET"}}', None,
         [("get_weather", '{"location": "Paris"}'), ("get_time", '{"tz": "CET"}')]),
        ('  {"name": "ping", "arguments": {}}', None, [("ping", "{}")]),
        ("I can't call a tool for that; the answer is 4.", "I can't call a tool for that; the answer is 4.", []),
        ('{"answer": 4}', '{"answer": 4}', None),  # an object that is no call: text
    ],
    "mistral": [
        (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}]', None, [("get_weather", WEATHER)]),
        ('Sure.[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "]}"}}]', "Sure.",
         [("a", '{"x": 1}'), ("b", '{"y": "]}"}')]),
        ('[TOOL_CALLS]get_weather[ARGS]{"location": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}', None,
         [("get_weather", '{"location": "Paris"}'), ("get_time", '{"tz": "CET"}')]),
        ("No tools needed [TOOL", "No tools needed [TOOL", []),
    ],
}


def _cases():
    for parser, outputs in RECORDED.items():
        for i, (text, content, calls) in enumerate(outputs):
            yield pytest.param(parser, text, content, calls, id=f"{parser}-{i}")


def _replay(parser: ToolParser, chunks: list[str]) -> tuple[str, list[tuple[str, str, str]]]:
    """A stream's deltas, added up: its content and its calls (id, name, arguments) by index."""
    content, calls = "", {}
    text = ""
    deltas = []
    for chunk in chunks:
        deltas.append(merge_deltas(parser.extract_streaming(text, chunk)))
        text += chunk
    deltas.append(merge_deltas(parser.finish(text)))
    for d in filter(None, deltas):
        content += d.get("content", "")
        for tc in d.get("tool_calls", ()):
            i = tc["index"]
            if i not in calls:
                assert tc["id"].startswith("chatcmpl-tool-") and tc["type"] == "function"  # id + name come first
                assert i == len(calls)
                calls[i] = [tc["id"], tc["function"]["name"], ""]
            else:
                assert "id" not in tc and "name" not in tc["function"]
            calls[i][2] += tc["function"].get("arguments", "")
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("name, text, content, calls", list(_cases()))
def test_a_recorded_output_parses_whole_and_streamed_at_every_split(name, text, content, calls):
    whole = TOOL_PARSERS[name]().extract(text)
    if calls is None:  # malformed calls: the whole text is the answer (a stream cannot take back what it sent)
        assert whole.content == text and not whole.tool_calls
        for i in range(len(text) + 1):
            _replay(TOOL_PARSERS[name](), [text[:i], text[i:]])
        return
    assert whole.content == content
    assert [(c.name, c.arguments) for c in whole.tool_calls] == calls
    for c in whole.tool_calls:
        json.loads(c.arguments)
        assert c.id.startswith("chatcmpl-tool-")
    want_content = whole.content or ""
    want_calls = [(c.name, c.arguments) for c in whole.tool_calls]
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for chunks in splits:
        got_content, got_calls = _replay(TOOL_PARSERS[name](), chunks)
        assert (got_content, [c[1:] for c in got_calls]) == (want_content, want_calls), chunks


def test_required_output_streams_its_calls():
    text = '[{"name": "get_weather", "parameters": {"location": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    whole = RequiredToolParser().extract(text)
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [("get_weather", '{"location": "Paris"}'),
                                                                 ("get_time", "{}")]
    assert whole.content is None
    for chunks in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        content, calls = _replay(RequiredToolParser(), chunks)
        assert content == "" and [c[1:] for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]


def test_named_output_is_the_arguments():
    text = '{"location": "Paris"}'
    assert NamedToolParser("get_weather").extract(text).tool_calls[0].arguments == text
    for chunks in [[text[:i], text[i:]] for i in range(len(text) + 1)]:
        content, calls = _replay(NamedToolParser("get_weather"), chunks)
        assert content == "" and [c[1:] for c in calls] == [("get_weather", text)]


def test_parsers_are_named_as_vllm_names_them():
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json", "mistral"}

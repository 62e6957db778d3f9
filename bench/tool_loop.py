"""The Agents-style tool loop (issue 26, acceptance 2): the openai client asks, the model calls a tool, the
script runs the local function and sends its result back, the model answers; N conversations at once.

    .venv/bin/python bench/tool_loop.py --base-url http://127.0.0.1:8000/v1 --model M -n 20

against any gateway + worker whose model's template has a tool format (for SmolLM2 on the CPU: its
weights with ``tests/qwen2_tool_template.jinja`` as ``chat_template.jinja``, as tests/test_tool_calls.py
serves it). The first turn uses ``--tool-choice`` (``required`` by default: a call is guaranteed; ``auto``
needs the gateway's ``--tool-call-parser``); the second sends the call and its result and lets the model
answer (``tool_choice: none``). Prints one JSON line: conversations completed, calls made, seconds.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

CITIES = ["Paris", "Berlin", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Delhi", "Rome"]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                       "required": ["city"], "additionalProperties": False}}},
]


def get_weather(city: str) -> dict:
    return {"city": city, "temperature_c": 10 + len(city), "sky": "clear"}


def get_time(city: str) -> dict:
    return {"city": city, "time": f"{len(city) % 12 + 1}:00"}


LOCAL = {"get_weather": get_weather, "get_time": get_time}


def conversation(client: OpenAI, model: str, i: int, tool_choice: str, max_tokens: int) -> int:
    """One conversation to its answer; the number of calls it ran (raises when it did not complete)."""
    messages = [{"role": "user", "content": f"What is the weather in {CITIES[i % len(CITIES)]}?"}]
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                           max_tokens=max_tokens, temperature=0.7, seed=i)
    msg = first.choices[0].message
    if not msg.tool_calls:
        raise RuntimeError(f"conversation {i}: no tool call ({msg.content!r})")
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls:
        result = LOCAL[call.function.name](**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=max_tokens, temperature=0.7, seed=i)
    if not isinstance(final.choices[0].message.content, str) or final.choices[0].message.tool_calls:
        raise RuntimeError(f"conversation {i}: no answer after the tool result")
    return len(msg.tool_calls)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--model", required=True)
    ap.add_argument("-n", type=int, default=20, help="conversations")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tool-choice", default="required", choices=["required", "auto"])
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=600)
    t0 = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        futures = [pool.submit(conversation, client, args.model, i, args.tool_choice, args.max_tokens) for i in range(args.n)]
        done, calls, errors = 0, 0, []
        for f in futures:
            try:
                calls += f.result()
                done += 1
            except Exception as exc:  # reported, not raised: the line says how many completed
                errors.append(str(exc)[:200])
    print(json.dumps({"conversations": args.n, "completed": done, "tool_calls": calls, "errors": errors,
                      "seconds": round(time.monotonic() - t0, 1), "tool_choice": args.tool_choice}))
    return 0 if done == args.n else 1


if __name__ == "__main__":
    sys.exit(main())

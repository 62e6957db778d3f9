"""Acceptance 1 and 6 of issue 10: ``pagestream serve --model <SmolLM2 dir>`` answers the openai client,
and its text equals ``LLM.generate`` / ``LLM.chat`` with the same seed (SmolLM2-135M on the CPU)."""
from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest
import redis

from private_redis import free_port
from queue_helpers import ROOT, wait_for
from test_gateway import DB_URL

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(smollm2_dir, tmp_path_factory):
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagestream.worker.cli", "serve", "--model", str(smollm2_dir), "--served-model-name", "smollm2",
         "--redis-url", DB_URL, "--port", str(port), "--device", "cpu", "--max-num-seqs", "4"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
    )

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited:\n{log_path.read_text()}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, 300, "pagestream serve", interval=0.5)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
    finally:
        proc.terminate()
        proc.wait(90)
        log.close()
        r.flushdb()


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    from pagestream.engine import LLM

    return LLM(smollm2_dir, device="cpu", max_num_seqs=4, seed=0)


def test_serve_answers_the_openai_client_with_the_engines_text(served, llm):
    from pagestream.engine import SamplingParams

    assert [m.id for m in served.models.list()] == ["smollm2"]

    params = SamplingParams(temperature=0.8, seed=7, max_tokens=12)
    want = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].text
    got = served.completions.create(model="smollm2", prompt="The capital of France is", temperature=0.8, seed=7, max_tokens=12)
    assert got.choices[0].text == want and got.usage.completion_tokens == 12

    msgs = [{"role": "user", "content": "Name a colour."}]
    want_chat = llm.chat(msgs, SamplingParams(temperature=0.7, seed=3, max_tokens=10), use_tqdm=False)[0].outputs[0].text
    chunks = served.chat.completions.create(model="smollm2", messages=msgs, temperature=0.7, seed=3, max_tokens=10, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want_chat

    two = served.chat.completions.create(model="smollm2", messages=msgs, n=2, temperature=1.0, seed=5, max_tokens=8)
    want_two = llm.chat(msgs, SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8), use_tqdm=False)[0].outputs
    assert [c.message.content for c in two.choices] == [o.text for o in want_two]

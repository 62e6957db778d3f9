"""The CLI when Redis is down (issue 8, item 8): one clear line on stderr, exit status 3, no traceback,
no password; for every command that talks to Redis."""
from __future__ import annotations

import pytest

from test_bulk_support import free_port
from tests.test_cli import cli

PASSWORD = "hunter2-not-shown"


@pytest.fixture(scope="module")
def down_url() -> str:
    """A Redis URL (with a password) where nothing listens."""
    return f"redis://app:{PASSWORD}@127.0.0.1:{free_port()}/11"


COMMANDS = {
    "submit": ["submit", "hello", "--max-tokens", "2"],
    "tail": ["tail", "some-job"],
    "stats": ["stats"],
    "bulk submit": ["bulk", "submit", "{input}", "--out", "{out}"],
    "bulk status": ["bulk", "status", "batch_x"],
    "bulk cancel": ["bulk", "cancel", "batch_x"],
    "bulk-worker": ["bulk-worker", "--burst"],
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_redis_down_is_one_line_and_exit_status_3(name, down_url, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    args = [a.format(input=tmp_path / "in.jsonl", out=tmp_path / "out") for a in COMMANDS[name]]
    out = cli(*args, "--redis-url", down_url, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 3, (out.returncode, out.stderr[-2000:])
    assert lines == [lines[0]] and lines[0].startswith("error: cannot reach Redis: "), out.stderr[-2000:]
    assert "Connection refused" in lines[0] and down_url.split("@")[1].split("/")[0] in lines[0]
    assert PASSWORD not in out.stderr + out.stdout
    assert not (tmp_path / "out").exists()

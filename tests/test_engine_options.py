"""Each engine knob is defined once (a field of EngineConfig) and reaches the worker's settings, the
options of ``pagestream worker`` and ``pagestream serve``, and the engine config a worker builds."""
from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from pagestream.engine.config import engine_knobs
from pagestream.worker import cli
from pagestream.worker.engine_options import engine_flags, engine_kwargs
from pagestream.worker.settings import WorkerSettings


def _flags(command: str) -> set[str]:
    out = CliRunner().invoke(cli.app, [command, "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"}).output
    return set(re.findall(r"--[a-z][a-z0-9-]*", out))


def test_every_engine_knob_is_an_option_of_worker_and_serve_with_help():
    knobs = {k.flag for k in engine_knobs()}
    assert {"--dtype", "--gpu-memory-utilization", "--block-size", "--max-num-batched-tokens", "--enforce-eager",
            "--max-num-seqs", "--tensor-parallel-size", "--load-format"} <= knobs
    worker, serve = _flags("worker"), _flags("serve")
    assert knobs <= worker, knobs - worker
    assert knobs <= serve, knobs - serve
    assert all(k.help for k in engine_knobs())


def test_a_knob_set_on_the_command_line_or_in_the_environment_reaches_the_engine_config(monkeypatch):
    seen = {}

    def capture(settings):
        seen.update(engine_kwargs(settings))
        raise typer.Exit(0)

    monkeypatch.setattr(cli, "build_engine", capture)
    monkeypatch.setenv("PAGESTREAM_KV_CACHE_BYTES", "1048576")
    res = CliRunner().invoke(cli.app, ["worker", "--model", "fake", "--block-size", "32", "--no-enable-prefix-caching",
                                       "--max-num-batched-tokens", "512"])
    assert res.exit_code == 0, res.output
    assert seen == {"block_size": 32, "enable_prefix_caching": False, "max_num_batched_tokens": 512,
                    "kv_cache_bytes": 1048576}


@pytest.mark.parametrize("options", [{"block_size": 32, "enforce_eager": True}, {"enable_prefix_caching": False, "dtype": "float16"}])
def test_serve_passes_the_knobs_it_was_given_to_its_worker_as_flags(options, monkeypatch):
    seen = {}

    def capture(settings):
        seen.update(engine_kwargs(settings))
        raise typer.Exit(0)

    monkeypatch.setattr(cli, "build_engine", capture)
    res = CliRunner().invoke(cli.app, ["worker", "--model", "fake", *engine_flags(options)])
    assert res.exit_code == 0, res.output
    assert seen == options
    assert engine_kwargs(WorkerSettings(**options)) == options

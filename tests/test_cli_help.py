"""Every ``pagestream`` option says in ``--help`` what it does, its default and its env name (issue 13)."""
from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from pagestream.worker.cli import app
from pagestream.worker.settings import WorkerSettings

#: env names a command reads that are not WorkerSettings fields
_SHARED_ENV = {"PAGESTREAM_REDIS_URL", "REDIS_URL", "PAGESTREAM_METRICS_PORT", "PAGESTREAM_METRICS_HOST", "PAGESTREAM_LOG_LEVEL"}


def _commands(cmd=None, path=("pagestream",)):
    cmd = cmd or typer.main.get_command(app)
    if hasattr(cmd, "commands"):  # a group
        for name, sub in cmd.commands.items():
            yield from _commands(sub, (*path, name))
    else:
        yield " ".join(path), cmd


COMMANDS = dict(_commands())


def test_the_walk_finds_every_command():
    assert {"pagestream worker", "pagestream submit", "pagestream bulk submit", "pagestream bulk-worker",
            "pagestream dlq retry", "pagestream gateway", "pagestream serve", "pagestream stats"} <= set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_parameter_has_help_and_a_shown_default(name):
    missing, no_default, hidden_env = [], [], []
    for p in COMMANDS[name].params:
        if p.name == "help":
            continue
        if not (getattr(p, "help", None) or "").strip():
            missing.append(p.name)
        is_option = p.param_type_name == "option"
        if is_option and not p.required and p.default is None and not isinstance(p.show_default, str):
            no_default.append(p.name)  # "[default: None]" or nothing says nothing: say what None means
        if is_option and p.envvar and not p.show_envvar:
            hidden_env.append(p.name)
    assert not missing, f"{name}: no help for {missing}"
    assert not no_default, f"{name}: default None without a show_default that says what it means: {no_default}"
    assert not hidden_env, f"{name}: reads an env var that --help does not show: {hidden_env}"


def test_worker_options_name_the_env_vars_the_settings_read():
    fields = {f"PAGESTREAM_{f.upper()}" for f in WorkerSettings.model_fields}
    for p in COMMANDS["pagestream worker"].params:
        if p.name in ("help", "burst"):
            continue
        envs = [p.envvar] if isinstance(p.envvar, str) else list(p.envvar or [])
        assert envs, f"--{p.name} has no env name"
        assert set(envs) <= fields | _SHARED_ENV, f"--{p.name}: {envs} is not a WorkerSettings field"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_renders(name):
    args = name.split()[1:] + ["--help"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "Usage" in res.output

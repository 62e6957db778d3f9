"""docker-compose.yml against the Compose Specification, without Docker (issue 13, acceptance 5).

The schema is the compose-spec JSON schema vendored in ``tests/schemas`` (source and version in
its README). Beyond the schema, what the spec cannot say: every container's process is started
with ``exec`` (no ``sh -c "... && pagestream"`` swallowing SIGTERM), every service has a
healthcheck, and every service, volume and healthy-dependency a service names exists.
"""
from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "tests" / "schemas" / "compose-spec.json"
SCHEMA_SHA256 = "d549057ebc2925f39f62799eab0db7b9e2c18b35b6c00595199116da3ed10e64"
SHELLS = {"sh", "bash", "/bin/sh", "/bin/bash", "ash", "/bin/ash", "dash"}


def load_compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def schema_errors(doc: dict) -> list[str]:
    schema = json.loads(SCHEMA.read_text())
    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)]


def _argv(value) -> list[str]:
    return value.split() if isinstance(value, str) else [str(v) for v in value or []]


def _dockerfile_entrypoint(build: dict | str | None) -> str | None:
    if not isinstance(build, dict) or not build.get("dockerfile_inline"):
        return None
    lines = [ln.strip() for ln in build["dockerfile_inline"].splitlines() if ln.strip().startswith("ENTRYPOINT")]
    return lines[-1] if lines else None


def compose_problems(doc: dict, entrypoint_script: str) -> list[str]:
    """What docker-compose.yml gets wrong beyond the schema (an empty list when all is well)."""
    problems: list[str] = []
    services = doc.get("services", {})
    volumes = set(doc.get("volumes") or {})
    for name, svc in services.items():
        for field in ("command", "entrypoint"):
            argv = _argv(svc.get(field))
            if argv and (argv[0] in SHELLS or any(a in ("-c", "&&", ";", "||") for a in argv)):
                problems.append(f"{name}: {field} runs a shell ({argv[:3]}...): signals reach the shell, not the process")
            if isinstance(svc.get(field), str):
                problems.append(f"{name}: {field} is a string (shell form); use a list so the process is PID 1")
        ep = _dockerfile_entrypoint(svc.get("build"))
        if svc.get("build") and "entrypoint" not in svc:
            if ep is None or not ep.startswith("ENTRYPOINT ["):
                problems.append(f"{name}: the image's ENTRYPOINT is missing or in shell form ({ep})")
        hc = svc.get("healthcheck")
        if not hc or hc.get("disable") or not hc.get("test"):
            problems.append(f"{name}: no healthcheck")
        for dep, cond in (svc.get("depends_on") or {}).items() if isinstance(svc.get("depends_on"), dict) else (
                (d, {}) for d in svc.get("depends_on") or []):
            if dep not in services:
                problems.append(f"{name}: depends on unknown service {dep!r}")
            elif (cond or {}).get("condition") == "service_healthy" and not services[dep].get("healthcheck"):
                problems.append(f"{name}: waits for {dep!r} to be healthy, which has no healthcheck")
        for vol in svc.get("volumes") or []:
            source = vol.split(":", 1)[0] if isinstance(vol, str) else vol.get("source")
            if source and not source.startswith(("/", ".", "~", "$")) and source not in volumes:
                problems.append(f"{name}: volume {source!r} is not declared under volumes:")
        for port in svc.get("ports") or []:
            if not str(port).startswith("127.0.0.1:"):
                problems.append(f"{name}: port {port} is published on every interface")
    # every way the entrypoint script starts a process replaces the shell
    for line in entrypoint_script.splitlines():
        code = line.split("#", 1)[0]
        if re.search(r"\bpagestream\b|\"\$@\"", code) and not re.search(r"\bexec\b", code) and "case" not in code:
            problems.append(f"entrypoint.sh starts a process without exec: {line.strip()}")
    return problems


def test_vendored_schema_is_the_recorded_release():
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == SCHEMA_SHA256


def test_compose_file_validates_against_the_compose_spec():
    assert schema_errors(load_compose()) == []


def test_every_service_execs_has_a_healthcheck_and_names_what_exists():
    script = (ROOT / "worker" / "entrypoint.sh").read_text()
    assert compose_problems(load_compose(), script) == []
    assert set(load_compose()["services"]) >= {"redis", "s3", "worker", "bulk-worker", "gateway"}


@pytest.mark.parametrize("breakage, expected", [
    (lambda d: d["services"]["worker"].update(command=["sh", "-c", "pip install . && pagestream worker"]), "runs a shell"),
    (lambda d: d["services"]["worker"].update(command="pagestream worker"), "shell form"),
    (lambda d: d["services"]["gateway"].pop("healthcheck"), "gateway: no healthcheck"),
    (lambda d: d["services"]["worker"]["depends_on"].update(minio={"condition": "service_healthy"}), "unknown service 'minio'"),
    (lambda d: d["services"]["redis"].update(volumes=["redis-state:/data"]), "'redis-state' is not declared"),
    (lambda d: d["services"]["gateway"].update(ports=["8000:8000"]), "every interface"),
])
def test_the_checks_catch_what_they_are_for(breakage, expected):
    doc = copy.deepcopy(load_compose())
    breakage(doc)
    script = (ROOT / "worker" / "entrypoint.sh").read_text()
    assert any(expected in p for p in compose_problems(doc, script)), compose_problems(doc, script)


def test_the_schema_refuses_what_compose_would_refuse():
    doc = copy.deepcopy(load_compose())
    doc["services"]["worker"]["stop_grace_period"] = ["40s"]  # not a duration
    doc["services"]["redis"]["restart_policy"] = "always"  # not a service field
    errors = schema_errors(doc)
    assert any("stop_grace_period" in e for e in errors) and any("restart_policy" in e for e in errors), errors


def test_entrypoint_without_exec_is_caught():
    bad = "#!/bin/sh\ncase \"$1\" in\n  worker) pagestream \"$@\" ;;\nesac\n"
    assert any("without exec" in p for p in compose_problems(load_compose(), bad))

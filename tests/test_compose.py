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
    if not isinstance(build, dict):
        return None
    if build.get("dockerfile_inline"):
        text = build["dockerfile_inline"]
    else:
        path = ROOT / build.get("context", ".") / build.get("dockerfile", "Dockerfile")
        text = path.read_text() if path.is_file() else ""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("ENTRYPOINT")]
    return lines[-1] if lines else None


def _depends(svc: dict) -> dict:
    dep = svc.get("depends_on") or {}
    return dep if isinstance(dep, dict) else {d: {} for d in dep}


def _one_shot(name: str, services: dict) -> bool:
    """A job that runs once (``restart: "no"``) and that others wait on until it exits 0: it needs no healthcheck."""
    return services[name].get("restart") == "no" and any(
        (_depends(s).get(name) or {}).get("condition") == "service_completed_successfully" for s in services.values())


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
        if (not hc or hc.get("disable") or not hc.get("test")) and not _one_shot(name, services):
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


# ---- issue 28: the stack works as shipped ----
def _env(svc: dict) -> dict:
    env = svc.get("environment") or {}
    return env if isinstance(env, dict) else dict(e.split("=", 1) for e in env)


def shipped_problems(doc: dict, makefile: str, dockerfile: str, dockerignore: str) -> list[str]:
    """What keeps ``docker compose up`` from answering as shipped (an empty list when all is well)."""
    problems: list[str] = []
    services = doc["services"]
    worker, gateway, bulk = services["worker"], services["gateway"], services["bulk-worker"]
    if not _env(worker).get("PAGESTREAM_SERVED_MODEL_NAME"):
        problems.append("worker: no served-model name (the gateway would list no models)")
    if not _env(worker).get("PAGESTREAM_MODEL"):
        problems.append("worker: no model")
    files = {n: _env(services[n]).get("PAGESTREAM_GATEWAY_FILES_URI") for n in ("gateway", "bulk-worker")}
    if files["gateway"] != files["bulk-worker"] or not str(files["gateway"] or "").startswith("s3://"):
        problems.append(f"gateway and bulk-worker do not share an S3 files store: {files}")
    for n in ("gateway", "bulk-worker"):
        if not _env(services[n]).get("PAGESTREAM_S3_ENDPOINT_URL", "").startswith("http://s3:"):
            problems.append(f"{n}: does not reach the s3 service")
    if services["redis"].get("ports"):
        problems.append(f"redis: host port published by default ({services['redis']['ports']})")
    cmd = _argv(services["redis"].get("command"))
    if "--appendonly" not in cmd or cmd[cmd.index("--appendonly") + 1] != "yes":
        problems.append("redis: no AOF")
    pin = re.search(r"^TORCH_SPEC \?= (\S+)", makefile, re.M).group(1)
    for n in ("worker", "bulk-worker", "gateway"):
        build = services[n].get("build") or {}
        if (build.get("args") or {}).get("TORCH_SPEC") != pin:
            problems.append(f"{n}: image's torch is not the Makefile's {pin}")
    if f"ARG TORCH_SPEC={pin}" not in dockerfile or '"${TORCH_SPEC}"' not in dockerfile:
        problems.append(f"Dockerfile: torch not pinned to {pin}")
    ignored = {ln.strip().rstrip("/").removeprefix("**/") for ln in dockerignore.splitlines() if ln.strip() and not ln.startswith("#")}
    if ".venv" not in ignored:
        problems.append(".dockerignore: .venv goes into the image")
    if "/worker/entrypoint.sh" not in dockerfile.split("ENTRYPOINT", 1)[-1]:
        problems.append("Dockerfile: ENTRYPOINT is not the exec entrypoint")
    hc = " ".join(_argv((worker.get("healthcheck") or {}).get("test")))
    if "pagestream.worker.readiness" not in hc:
        problems.append(f"worker: healthcheck does not mean ready ({hc})")
    if (gateway.get("depends_on") or {}).get("worker", {}).get("condition") != "service_healthy":
        problems.append("gateway: starts before a worker is ready")
    grace = int(str(worker.get("stop_grace_period", "10s")).rstrip("s"))
    if grace <= float(_env(worker).get("PAGESTREAM_DRAIN_TIMEOUT_S", 30)):
        problems.append("worker: stop_grace_period not longer than the drain timeout")
    for vol in worker.get("volumes") or []:
        src = vol[:vol.index("}") + 1] if vol.startswith("${") else vol.split(":", 1)[0]
        default = re.fullmatch(r"\$\{\w+:-(.+)\}", src)
        path = default.group(1) if default else src
        if path.startswith(".") and not (ROOT / path).exists():
            problems.append(f"worker: default mount {path} does not exist")
    return problems


def _shipped(doc=None) -> list[str]:
    return shipped_problems(doc or load_compose(), (ROOT / "Makefile").read_text(), (ROOT / "Dockerfile").read_text(),
                            (ROOT / ".dockerignore").read_text())


def test_the_stack_as_shipped_names_its_model_shares_its_files_and_pins_torch():
    assert _shipped() == []


@pytest.mark.parametrize("breakage, expected", [
    (lambda d: d["services"]["worker"]["environment"].pop("PAGESTREAM_SERVED_MODEL_NAME"), "no served-model name"),
    (lambda d: d["services"]["gateway"]["environment"].update(PAGESTREAM_GATEWAY_FILES_URI="/root/.cache/files"), "share"),
    (lambda d: d["services"]["redis"].update(ports=["127.0.0.1:6379:6379"]), "host port"),
    (lambda d: d["services"]["worker"]["build"]["args"].update(TORCH_SPEC="torch"), "Makefile"),
    (lambda d: d["services"]["worker"].update(stop_grace_period="20s"), "drain timeout"),
    (lambda d: d["services"]["worker"].update(volumes=["${MODEL_DIR:-./model}:/model:ro"]), "does not exist"),
    (lambda d: d["services"]["worker"].update(healthcheck={"test": ["CMD", "true"]}), "does not mean ready"),
])
def test_the_shipped_checks_catch_what_they_are_for(breakage, expected):
    doc = copy.deepcopy(load_compose())
    breakage(doc)
    assert any(expected in p for p in _shipped(doc)), _shipped(doc)


def test_dockerignore_breakage_is_caught():
    got = shipped_problems(load_compose(), (ROOT / "Makefile").read_text(), (ROOT / "Dockerfile").read_text(), "*.pyc\n")
    assert any(".venv" in p for p in got)


def _compose_command() -> list[str] | None:
    """Docker's compose plugin, else Debian's standalone ``docker-compose`` (1.29, which knows profiles and renders
    ``config`` without a Docker daemon; .ci/run installs it)."""
    import shutil
    import subprocess

    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def test_docker_compose_config_renders_the_file(tmp_path):
    import os
    import subprocess

    if _compose_command() is None:
        if "docker-compose" in os.environ.get("PAGESTREAM_TEST_REQUIRE", "").split(","):  # CI: .ci/run installs it
            pytest.fail("neither docker compose nor docker-compose is here and PAGESTREAM_TEST_REQUIRE asks for it")
        pytest.skip("neither docker compose nor docker-compose here (the schema tests above still run)")

    for files in (["-f", "docker-compose.yml"], ["-f", "docker-compose.yml", "-f", "deploy/compose/gpu.yml"],
                  ["-f", "docker-compose.yml", "-f", "deploy/compose/expose-redis.yml"],
                  ["-f", "docker-compose.yml", "--profile", "observability"]):
        out = subprocess.run([*_compose_command(), *files, "config"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (files, out.stderr)
        rendered = yaml.safe_load(out.stdout)
        assert rendered["services"]["worker"]["environment"]["PAGESTREAM_SERVED_MODEL_NAME"]
        if "observability" in files:  # the profile's services, their files mounted from the repo
            mounts = " ".join(str(v) for svc in ("prometheus", "grafana") for v in rendered["services"][svc].get("volumes", []))
            assert "prometheus.yml" in mounts and "alerts.yml" in mounts and "grafana" in mounts, mounts
    broken = load_compose()
    broken["services"]["worker"]["depends_on"] = 7  # the renderer itself refuses a file against the spec
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(yaml.safe_dump(broken))
    out = subprocess.run([*_compose_command(), "-f", str(bad), "--project-directory", str(ROOT), "config"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "depends_on" in out.stderr, out.stderr


def test_the_override_files_validate_against_the_compose_spec():
    for name in ("gpu.yml", "expose-redis.yml"):
        assert schema_errors(yaml.safe_load((ROOT / "deploy" / "compose" / name).read_text())) == [], name


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

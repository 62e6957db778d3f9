"""Issue 28, acceptance 4: the Kubernetes manifests under deploy/kubernetes validate offline (the
Kubernetes API schemas bundled with ``kubernetes-validate``; KEDA's ScaledObject CRD vendored in
``deploy/schemas``), and the KEDA triggers name the streams and consumer group a worker really reads
(a real worker against the real Redis creates its group on exactly those streams)."""
from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import redis
import yaml
from jsonschema import Draft7Validator

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.lanes import LaneLayout
from pagestream.worker import keda, readiness
from queue_helpers import ROOT, WorkerProc, wait_for
from test_gateway import DB_URL

K8S = ROOT / "deploy" / "kubernetes"
CRD = ROOT / "deploy" / "schemas" / "keda.sh_scaledobjects.yaml"
#: kedacore/keda v2.20.1 (875675ce5cd1d34772fe00a228a71b8bf05b3b43), config/crd/bases/keda.sh_scaledobjects.yaml
CRD_SHA256 = "af35555862a83933b074af14ad439c4b4ceabaf4daa3e9338e9b23e36d308d80"
K8S_VERSION = "1.37.0"


def manifests() -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        out += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def scaled_object_errors(doc: dict) -> list[str]:
    crd = yaml.safe_load(CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == doc["apiVersion"].split("/")[1])
    validator = Draft7Validator(version["schema"]["openAPIV3Schema"])
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_vendored_keda_crd_is_the_recorded_release():
    assert hashlib.sha256(CRD.read_bytes()).hexdigest() == CRD_SHA256


def test_every_manifest_validates_against_the_kubernetes_and_keda_schemas():
    docs = manifests()
    assert {d["kind"] for _, d in docs} >= {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap", "ScaledObject"}
    errors = []
    for path, doc in docs:
        if doc["kind"] == "ScaledObject":
            errors += [f"{path.name}: {e}" for e in scaled_object_errors(doc)]
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{path.name} {doc['kind']}: {exc.message}")
    assert errors == []


def test_the_validators_refuse_broken_manifests():
    worker = next(d for p, d in manifests() if p.name == "worker.yaml")
    worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "sixty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, K8S_VERSION, strict=True)
    so = keda.scaled_object("m", deployment="w", redis_addresses=["redis:6379"])
    so["spec"]["minReplicaCount"] = "zero"
    so["spec"]["triggers"][0].pop("type")
    assert len(scaled_object_errors(so)) >= 2


def test_every_kustomization_names_files_that_exist():
    for kust in K8S.rglob("kustomization.yaml"):
        doc = yaml.safe_load(kust.read_text())
        for entry in doc.get("resources", []) + [p["path"] for p in doc.get("patches", [])]:
            assert (kust.parent / entry).exists(), f"{kust}: {entry}"


def test_worker_drains_within_its_grace_has_a_gpu_and_probes_its_health():
    docs = {(p.name, d["kind"]): d for p, d in manifests() if "base" in p.parts}
    pod = docs[("worker.yaml", "Deployment")]["spec"]["template"]["spec"]
    config = docs[("config.yaml", "ConfigMap")]["data"]
    assert pod["terminationGracePeriodSeconds"] > float(config["PAGESTREAM_DRAIN_TIMEOUT_S"])
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["readinessProbe"]["exec"]["command"] == ["python", "-m", "pagestream.worker.readiness"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/metrics"
    env = {e["name"]: e for e in c["env"]}
    assert env["PAGESTREAM_SERVED_MODEL_NAME"]["value"]
    assert env["PAGESTREAM_CONSUMER"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    hpa = docs[("gateway.yaml", "HorizontalPodAutoscaler")]
    assert any(m["type"] == "Pods" and "requests" in m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"])


@pytest.mark.parametrize("overlay, args", [
    ("base", dict(redis_addresses=["redis:6379"])),
    ("redis-cluster", dict(cluster=True, num_shards=8, redis_addresses=[
        f"redis-cluster-{i}.redis-cluster-headless:6379" for i in range(3)])),
])
def test_the_shipped_scaled_objects_are_what_the_renderer_gives(overlay, args):
    shipped = yaml.safe_load((K8S / overlay / "scaledobject.yaml").read_text())
    worker = next(d for p, d in manifests() if p.name == "worker.yaml")
    model = {e["name"]: e.get("value") for e in worker["spec"]["template"]["spec"]["containers"][0]["env"]}["PAGESTREAM_SERVED_MODEL_NAME"]
    assert shipped == keda.scaled_object(model, deployment=worker["metadata"]["name"], **args)


def test_keda_triggers_read_the_models_lanes_in_the_workers_group_from_the_contract():
    so = keda.scaled_object("llama-8b", deployment="w", redis_addresses=["r:6379"], min_replicas=0)
    trig = so["spec"]["triggers"]
    want = [s for lane in keys.LANES for s in LaneLayout(1).streams(lane, "llama-8b")]
    assert [t["metadata"]["stream"] for t in trig if t["name"].endswith("-lag")] == want
    assert {t["metadata"]["consumerGroup"] for t in trig} == {keys.DEFAULT_GROUP}
    assert so["spec"]["minReplicaCount"] == 0 and all("activationLagCount" in t["metadata"] for t in trig if "lagCount" in t["metadata"])
    sharded = keda.triggers("llama-8b", redis_addresses=["a:1", "b:2"], cluster=True, num_shards=4)
    assert {t["metadata"]["stream"] for t in sharded} == {s for lane in keys.LANES for s in LaneLayout(4).streams(lane, "llama-8b")}
    assert {t["type"] for t in sharded} == {"redis-cluster-streams"} and sharded[0]["metadata"]["addresses"] == "a:1,b:2"


@pytest.mark.slow
def test_a_real_worker_creates_its_group_on_the_streams_the_keda_triggers_name(tmp_path):
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    w = WorkerProc(DB_URL, "fake", "keda-w", "--served-model-name", "llama-8b", log_dir=tmp_path)
    try:
        w.wait_ready()
        trig = keda.triggers("llama-8b", redis_addresses=["r:6379"])

        def groups_made() -> bool:
            return all(r.exists(t["metadata"]["stream"]) for t in trig)

        wait_for(groups_made, 30, "the worker's consumer groups")
        for t in trig:
            names = {g["name"].decode() for g in r.xinfo_groups(t["metadata"]["stream"])}
            assert t["metadata"]["consumerGroup"] in names, (t, names)
        # and what the readiness probe reads: this worker's heartbeat and announcement
        wait_for(lambda: r.exists(keys.worker_hash("keda-w")), 30, "heartbeat")
    finally:
        w.signal(signal.SIGTERM)
        w.proc.wait(60)
        r.flushdb()


def test_the_readiness_probe_reads_the_heartbeat_and_announcement(monkeypatch, capsys):
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    monkeypatch.setenv("PAGESTREAM_REDIS_URL", DB_URL)
    monkeypatch.setenv("PAGESTREAM_CONSUMER", "pod-a")
    monkeypatch.setenv("PAGESTREAM_SERVED_MODEL_NAME", "m")
    try:
        assert readiness.main() == 1 and "pod-a" in capsys.readouterr().err
        r.hset(keys.worker_hash("pod-a"), "num_running", 0)
        r.zadd(keys.model_registry(), {"m": int((time.time() + 10) * 1000)})
        assert readiness.main() == 0
        monkeypatch.setenv("PAGESTREAM_REDIS_URL", "redis://127.0.0.1:1/0")
        assert readiness.main() == 3
    finally:
        r.flushdb()

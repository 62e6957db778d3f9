"""deploy/observability as shipped (issue 27, acceptance 4): the Grafana dashboard's and the alert rules' metrics are
the ones a gateway and a worker really expose after traffic; the rules pass ``promtool check rules`` and fire on the
series they are for (``promtool test rules``); the compose profile wires Prometheus and Grafana to those files."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from gateway_helpers import DB_URL, gateway_stack, read_sse
from private_redis import free_port
from test_compose import load_compose, schema_errors

ROOT = Path(__file__).resolve().parents[1]
OBS = ROOT / "deploy" / "observability"
DASHBOARD = OBS / "grafana" / "dashboards" / "pagestream.json"
ALERTS = OBS / "alerts.yml"
PROMETHEUS = OBS / "prometheus.yml"


def require_tool(name: str) -> str:
    """The tool's path; skipped without it, failed without it where PAGESTREAM_TEST_REQUIRE names it (CI)."""
    path = shutil.which(name)
    if path is None:
        if name in os.environ.get("PAGESTREAM_TEST_REQUIRE", "").split(","):
            pytest.fail(f"{name} is not on PATH and PAGESTREAM_TEST_REQUIRE asks for it (.ci/run installs it)")
        pytest.skip(f"no {name} on PATH")
    return path


# ---- PromQL: the metric names an expression reads ----
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                   "offset", "atan2", "inf", "nan"}
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def promql_metric_names(expr: str) -> set[str]:
    """Every metric name ``expr`` selects: identifiers that are not functions (followed by ``(``), keywords,
    label names (inside ``{...}``, ``by (...)``, ``on (...)``...), durations or Grafana's ``$variables``."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # string literals
    s = re.sub(r"#[^\n]*", "", s)  # comments
    s = re.sub(r"\blabel_values\(\s*([^,()]*?)\s*,\s*[a-zA-Z_]\w*\s*\)", r" \1 ", s)  # Grafana's variable query
    s = re.sub(r"\{[^{}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range and subquery selectors
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", s)  # label lists
    s = re.sub(r"\boffset\s+-?[0-9a-z]+", " ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)  # $__rate_interval, ${model}
    names = set()
    for m in _IDENT.finditer(s):
        name, rest = m.group(), s[m.end():]
        if m.start() > 0 and (s[m.start() - 1].isdigit() or s[m.start() - 1] == "."):
            continue  # the tail of a number: 1e3, 0.99
        if rest.lstrip().startswith("(") or name.lower() in PROMQL_KEYWORDS:
            continue
        names.add(name)
    return names


@pytest.mark.parametrize("expr, expected", [
    ('histogram_quantile(0.95, sum by (le, model_name) (rate(vllm:time_to_first_token_seconds_bucket{model_name=~"$model"}[$__rate_interval])))',
     {"vllm:time_to_first_token_seconds_bucket"}),
    ('sum by (model_name) (pagestream_queue_depth) > 0\nand on (model_name)\nmax by (model_name) (pagestream_model_served) == 0',
     {"pagestream_queue_depth", "pagestream_model_served"}),
    ('sum(rate(x_total{status=~"5..", a="by (b)"}[5m])) / sum(rate(x_total[5m] offset 1h)) > 1e3', {"x_total"}),
    ("min_over_time(vllm:kv_cache_usage_perc[10m:1m]) >= 0.99", {"vllm:kv_cache_usage_perc"}),
    ("sum(a) by (le) * on(instance) group_left(model_name) b unless c", {"a", "b", "c"}),
    ("label_values(pagestream_queue_depth, model_name)", {"pagestream_queue_depth"}),
    ("{__name__=~\"foo.*\"}", set()),
])
def test_promql_metric_names_are_read_out_of_expressions(expr, expected):
    assert promql_metric_names(expr) == expected


def dashboard_exprs(dash: dict) -> list[str]:
    exprs = []

    def panels(ps):
        for p in ps:
            yield p
            yield from panels(p.get("panels") or [])

    for p in panels(dash.get("panels") or []):
        exprs += [t["expr"] for t in p.get("targets") or [] if t.get("expr")]
    for v in (dash.get("templating") or {}).get("list") or []:
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if v.get("type") == "query" and q:
            exprs.append(q)
    return exprs


def alert_exprs(rules: dict) -> list[str]:
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def exposed(name: str, samples: set[str]) -> bool:
    """``name`` is a sample the scrapes hold (a histogram's ``_bucket``/``_sum``/``_count`` stand for it too)."""
    return name in samples or any(name + s in samples for s in ("_bucket", "_sum", "_count"))


def test_the_dashboard_and_rules_cover_what_the_issue_asks_for():
    dash = json.loads(DASHBOARD.read_text())
    used = set().union(*map(promql_metric_names, dashboard_exprs(dash)))
    for name in ("pagestream_queue_depth", "pagestream_queue_oldest_age_seconds", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:generation_tokens_total", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                 "pagestream_dead_letters_total", "pagestream_gateway_requests_total"):
        assert name in used, name
    ds = {p["datasource"]["uid"] for p in dash["panels"] if p.get("datasource")}
    provisioned = yaml.safe_load((OBS / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds == {d["uid"] for d in provisioned["datasources"]}, "a panel names a data source Grafana is not given"
    rules = yaml.safe_load(ALERTS.read_text())
    alert_names = {n for e in alert_exprs(rules) for n in promql_metric_names(e)}
    assert {"pagestream_queue_oldest_age_seconds", "pagestream_dead_letters_total", "pagestream_model_served",
            "vllm:kv_cache_usage_perc"} <= alert_names


# ---- the names, exposed by a real gateway and worker after traffic ----
def test_every_metric_the_dashboard_and_rules_read_is_exposed_after_traffic(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    model = "obs-model"
    metrics_port = free_port()
    with gateway_stack(DB_URL, tmp_path, model, f"obs-{uuid.uuid4().hex[:6]}", "--metrics-port", str(metrics_port),
                       "--max-model-len", "256") as st:
        base = f"http://127.0.0.1:{st['gw'].port}"
        with httpx.Client(timeout=60) as http:
            for i in range(3):
                body = {"model": model, "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 8}
                with http.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}) as resp:
                    assert resp.status_code == 200
                    assert read_sse(resp)[-1]["data"] == "[DONE]"
                assert http.post(f"{base}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4}).status_code == 200
            assert http.get(f"{base}/v1/nope").status_code == 404
            gateway_text = http.get(f"{base}/metrics").text
            worker_text = http.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    samples = {s.name for text in (gateway_text, worker_text) for f in text_string_to_metric_families(text) for s in f.samples}
    dash_names = set().union(*map(promql_metric_names, dashboard_exprs(json.loads(DASHBOARD.read_text()))))
    rule_names = set().union(*map(promql_metric_names, alert_exprs(yaml.safe_load(ALERTS.read_text()))))
    assert len(dash_names) >= 15 and rule_names
    missing = sorted(n for n in dash_names | rule_names if not exposed(n, samples))
    assert missing == [], f"queried but not exposed after traffic: {missing}"
    # and the series carry the labels the panels group by
    fams = {f.name: f for text in (gateway_text, worker_text) for f in text_string_to_metric_families(text)}
    depth = [s for s in fams["pagestream_queue_depth"].samples if s.labels.get("model_name") == model]
    assert {s.labels["lane"] for s in depth} >= {"high", "normal", "low"}
    assert [s.value for s in fams["pagestream_model_served"].samples if s.labels["model_name"] == model] == [1.0]
    assert any(s.labels.get("model_name") == model for s in fams["vllm:kv_cache_usage_perc"].samples)


# ---- the rules: promtool's own checks, and each alert firing on the series it is for ----
def test_alert_rules_pass_promtool_check_rules():
    promtool = require_tool("promtool")
    out = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_rejects_a_broken_rule(tmp_path):
    """The check above can fail: a rule with a PromQL syntax error does not pass it."""
    promtool = require_tool("promtool")
    rules = yaml.safe_load(ALERTS.read_text())
    rules["groups"][0]["rules"][0]["expr"] = "max by (model_name (pagestream_queue_oldest_age_seconds) > 300"
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump(rules))
    out = subprocess.run([promtool, "check", "rules", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0


RULE_TESTS = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'pagestream_queue_oldest_age_seconds{{model_name="m",lane="normal"}}'
        values: '0 60 400 460 520 580 640'
      - series: 'pagestream_queue_depth{{model_name="m",lane="normal"}}'
        values: '3x10'
      - series: 'pagestream_model_served{{model_name="m"}}'
        values: '1 1 0 0 0 0 0 0 0 0'
      - series: 'pagestream_queue_depth{{model_name="idle",lane="normal"}}'
        values: '0x10'
      - series: 'pagestream_model_served{{model_name="idle"}}'
        values: '0x10'
      - series: 'pagestream_dead_letters_total{{instance="w1"}}'
        values: '0 0 0 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1'
      - series: 'vllm:kv_cache_usage_perc{{model_name="m",instance="w1"}}'
        values: '1x15'
      - series: 'vllm:kv_cache_usage_perc{{model_name="m",instance="w2"}}'
        values: '1 1 1 1 0.5 1 1 1 1 1 1 1 1 1 1 1'
    alert_rule_test:
      - eval_time: 1m
        alertname: PagestreamOldestJobTooOld
        exp_alerts: []
      - eval_time: 5m
        alertname: PagestreamOldestJobTooOld
        exp_alerts:
          - exp_labels: {{severity: warning, model_name: m, lane: normal}}
      - eval_time: 2m
        alertname: PagestreamNoWorkerForQueuedModel
        exp_alerts: []
      - eval_time: 4m
        alertname: PagestreamNoWorkerForQueuedModel
        exp_alerts:
          - exp_labels: {{severity: critical, model_name: m}}
      - eval_time: 2m
        alertname: PagestreamDeadLettersGrowing
        exp_alerts: []
      - eval_time: 5m
        alertname: PagestreamDeadLettersGrowing
        exp_alerts:
          - exp_labels: {{severity: warning}}
      - eval_time: 19m
        alertname: PagestreamDeadLettersGrowing
        exp_alerts: []
      - eval_time: 11m
        alertname: PagestreamKvCachePinned
        exp_alerts:
          - exp_labels: {{severity: warning, model_name: m, instance: w1}}
"""


def test_each_alert_fires_on_the_series_it_is_for_and_not_before(tmp_path):
    """``promtool test rules``: the oldest job past 5 minutes, a model with queued jobs and no live worker (the idle
    model with nothing queued stays quiet), a dead letter in the last 10 minutes, KV usage at 100% for 10 minutes
    (the worker that dipped to 50% does not fire)."""
    promtool = require_tool("promtool")
    rules = yaml.safe_load(ALERTS.read_text())
    for g in rules["groups"]:
        for r in g["rules"]:
            r.pop("annotations", None)  # promtool compares them too: what fires is the question here
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules))
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(RULE_TESTS.format(rules="alerts.yml"))
    out = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_scrape_config_passes_promtool_and_names_the_compose_services(tmp_path):
    promtool = require_tool("promtool")
    conf = yaml.safe_load(PROMETHEUS.read_text())
    doc = load_compose()
    services = doc["services"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"] if v.startswith("./")}
    for rule_file in conf["rule_files"]:
        assert rule_file in mounts and (ROOT / mounts[rule_file]).resolve() == ALERTS.resolve(), rule_file
    # the targets are the services' metrics ports
    targets = {j["job_name"]: j for j in conf["scrape_configs"]}
    gw_port = services["gateway"]["command"][services["gateway"]["command"].index("--port") + 1]
    assert targets["pagestream-gateway"]["static_configs"][0]["targets"] == [f"gateway:{gw_port}"]
    sd = targets["pagestream-worker"]["dns_sd_configs"][0]
    assert sd["names"] == ["worker"] and str(sd["port"]) == services["worker"]["environment"]["PAGESTREAM_METRICS_PORT"]
    assert services["worker"]["environment"]["PAGESTREAM_METRICS_HOST"] == "0.0.0.0"
    # promtool's config check, with the rule file where this machine has it
    local = dict(conf, rule_files=[str(ALERTS)])
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(local))
    out = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_observability_profile_provisions_the_dashboard():
    doc = load_compose()
    assert schema_errors(doc) == []
    services = doc["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["observability"], name
    # the default `docker compose up` stays as it was: no other service joins the profile
    assert [n for n, s in services.items() if s.get("profiles")] == ["prometheus", "grafana"]
    mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in services["grafana"]["volumes"] if v.startswith("./")}
    provisioning = mounts["/etc/grafana/provisioning"]
    providers = yaml.safe_load((provisioning / "dashboards" / "pagestream.yml").read_text())["providers"]
    path = providers[0]["options"]["path"]
    assert path in mounts and (mounts[path] / DASHBOARD.name).resolve() == DASHBOARD.resolve()
    ds = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    prom_port = services["prometheus"]["ports"][0].rsplit(":", 1)[1]
    assert ds["url"] == f"http://prometheus:{prom_port}"
    assert (services["grafana"]["depends_on"]["prometheus"]["condition"]) == "service_healthy"

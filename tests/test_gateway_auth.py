"""API keys guard every route of the gateway but the probes: one dependency on the routers, so a
new route cannot forget it (walked over the app's own routes, not a list kept by hand)."""
from __future__ import annotations

import re

from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from pagestream.producer.gateway.app import create_app
from pagestream.producer.gateway.settings import GatewaySettings

# vLLM leaves its probes open too (its API-key check covers /v1 only); /invocations submits jobs, so it keeps the key
OPEN = {"/health", "/ping", "/version", "/load", "/metrics", "/openapi.json"}
# the dashboard's login form (it checks a key itself), logout, and its static files (script, style, uPlot: no data);
# tests/test_dashboard.py drives them
DASHBOARD_OPEN = {"/dashboard/login", "/dashboard/logout", "/dashboard/static/{name:path}"}


def _routes(routes):
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _routes(inner.routes)
        elif isinstance(route, APIRoute) or hasattr(route, "methods"):
            yield route


def test_every_route_but_the_probes_answers_401_without_the_key(redis_url, monkeypatch):
    from pagestream.producer.gateway.dashboard import api_router as dashboard

    monkeypatch.setattr(dashboard, "FEED_MAX_S", 0.0)  # the dashboard's live feed ends after its first event
    app = create_app(GatewaySettings(redis_url=redis_url, api_keys=["k1"]))
    checked = []
    with TestClient(app) as client:
        for route in _routes(app.routes):
            path = re.sub(r"\{[^}]+\}", "x", route.path)
            for method in sorted(route.methods - {"HEAD"}):
                resp = client.request(method, path, json={})
                if route.path in DASHBOARD_OPEN:
                    continue
                if route.path in OPEN:
                    assert resp.status_code != 401, (method, path)
                    continue
                checked.append((method, route.path))
                assert resp.status_code == 401, (method, path, resp.status_code)
                if route.path == "/dashboard":  # the page answers with its login form
                    assert 'name="key"' in resp.text and "Bearer" in resp.headers["www-authenticate"]
                else:
                    assert resp.json()["error"]["code"] == "invalid_api_key"
                ok = client.request(method, path, json={}, headers={"Authorization": "Bearer k1"})
                assert ok.status_code != 401, (method, path)
    assert ("POST", "/invocations") in checked and ("GET", "/v1/models/{model:path}") in checked
    assert ("GET", "/dashboard") in checked and ("GET", "/dashboard/api/events") in checked
    assert ("POST", "/v1/chat/completions") in checked and ("GET", "/v1/files/{file_id}/content") in checked


def test_a_started_gateway_keeps_what_startup_built_out_of_the_collectors_scans(redis_url):
    """Startup imports torch and xgrammar for the grammar check (~270,000 objects): a full collection of them
    took ~180 ms of the event loop, under load every few hundred requests. Started, they are frozen."""
    import subprocess
    import sys
    code = ("import gc, sys\nfrom fastapi.testclient import TestClient\n"
            "from pagestream.producer.gateway.app import create_app\n"
            "from pagestream.producer.gateway.settings import GatewaySettings\n"
            "with TestClient(create_app(GatewaySettings(redis_url=sys.argv[1]))) as c:\n"
            "    assert c.get('/health').status_code == 200\n"
            "    print(gc.get_freeze_count(), len(gc.get_objects()))\n")
    out = subprocess.run([sys.executable, "-c", code, redis_url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    frozen, scanned = map(int, out.stdout.split())
    assert frozen > 100_000 and scanned < frozen // 4, (frozen, scanned)

"""The gateway's live dashboard (issue 27, acceptance 2) in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by selenium): with a worker and jobs running, the page's queue depth, worker and bulk
progress match Redis, a job that finishes shows up without a reload, the browser logs no error, and screenshots
at desktop and phone widths are kept (``PAGESTREAM_DASHBOARD_SHOTS``, else pytest's tmp dir). Without a key the
page and its feed answer 401; another tenant's job ids are not on the page."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from gateway_helpers import batch_stack, openai_client
from queue_helpers import wait_for
from pagestream.producer import Producer
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.bulk import BulkField

pytestmark = pytest.mark.slow

MODEL = "fake-dash"
ALICE, BOB, OPS = "alice-dash-key", "bob-dash-key", "ops-dash-key"
DESKTOP, PHONE = (1366, 1000), (390, 844)


def _browser_paths() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        msg = "Debian's chromium and chromium-driver are needed (.ci/run installs them)"
        if "chromium" in os.environ.get("PAGESTREAM_TEST_REQUIRE", "").split(","):  # CI: .ci/run sets it
            pytest.fail(msg)
        pytest.skip(msg)
    return chromium, driver


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with batch_stack(tmp_path_factory.mktemp("dash"), tmp_path_factory.mktemp("dash-files"), MODEL, "dash-worker",
                     "--api-keys", f"{ALICE}:alice,{BOB}:bob,{OPS}:ops:admin", engine="fake:20",
                     worker_args=("--max-model-len", "256", "--max-num-seqs", "2")) as s:
        s["base"] = f"http://127.0.0.1:{s['gw'].port}"
        yield s


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver_path = _browser_paths()
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={DESKTOP[0]},{DESKTOP[1]}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(options=opts, service=Service(driver_path))
    try:
        yield d
    finally:
        d.quit()


@pytest.fixture
def shots(tmp_path) -> Path:
    out = Path(os.environ.get("PAGESTREAM_DASHBOARD_SHOTS") or tmp_path / "screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _login(d, base: str, key: str) -> None:
    from selenium.webdriver.common.by import By

    d.get(base + "/dashboard")
    d.find_element(By.ID, "key").send_keys(key)
    d.find_element(By.CSS_SELECTOR, "form button").click()
    wait_for(lambda: d.find_element(By.ID, "conn").text == "live", 30, "the dashboard's feed live")
    # before the key was given, /dashboard answered 401 (the login form): the one error the browser may have logged
    before = [e["message"] for e in d.get_log("browser") if e["level"] == "SEVERE"]
    assert all("/dashboard - " in m and "401" in m for m in before), before


def _cells(d, selector: str) -> list[str]:
    return d.execute_script(f"return Array.from(document.querySelectorAll({json.dumps(selector)})).map(e => e.textContent)")


def _redis_depth(r, lane: str) -> int:
    """Undelivered entries of ``MODEL``'s lane, as Redis says (the workers' group lag)."""
    groups = r.xinfo_groups(keys.jobs_stream(lane, MODEL))
    g = next(g for g in groups if g["name"] in (b"workers", "workers", keys.DEFAULT_GROUP.encode()))
    return int(g["lag"])


def test_without_a_key_the_page_and_its_feed_answer_401(stack):
    base = stack["base"]
    with httpx.Client(base_url=base, timeout=10, follow_redirects=False) as c:
        page = c.get("/dashboard")
        assert page.status_code == 401 and 'name="key"' in page.text and MODEL not in page.text
        for path in ("/dashboard/api/events", "/dashboard/api/state"):
            assert c.get(path).status_code == 401
            assert c.get(path, headers={"Authorization": "Bearer not-a-key"}).status_code == 401
            assert httpx.get(base + path, cookies={"pagestream_dashboard": "not-a-key"}).status_code == 401
        assert c.post("/dashboard/login", data={"key": "not-a-key"}).status_code == 401
        # a good key: a cookie the /v1 API never reads, HttpOnly, SameSite=Strict, on /dashboard only
        ok = c.post("/dashboard/login", data={"key": BOB})
        assert ok.status_code == 303
        cookie = ok.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/dashboard" in cookie
        assert httpx.get(base + "/dashboard", cookies={"pagestream_dashboard": BOB}).status_code == 200
        assert httpx.get(base + "/v1/models", cookies={"pagestream_dashboard": BOB}).status_code == 401
        assert c.get("/dashboard/api/state", headers={"Authorization": f"Bearer {BOB}"}).json()["tenant"]["name"] == "bob"


def test_the_page_matches_redis_and_updates_live(stack, browser, shots, tmp_path):
    from selenium.webdriver.common.by import By

    r, base, d = stack["r"], stack["base"], browser
    producer = Producer(r)
    alice = openai_client(stack["gw"], ALICE)
    # alice's batch of 6 lines (a bulk the bulk-worker feeds)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 40}}
             for i in range(6)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    batch = alice.batches.create(input_file_id=alice.files.create(file=src.open("rb"), purpose="batch").id,
                                 endpoint="/v1/chat/completions", completion_window="24h")

    _login(d, base, ALICE)
    assert d.find_element(By.ID, "tenant").text == "alice"

    # a job of alice's that finishes after the page loaded shows up without a reload; bob's never does
    bob_job = producer.submit(prompt="bob's secret", model=MODEL, max_tokens=3, metadata={"tenant": "bob"}, lane="high")
    mine = producer.submit(prompt="alice's", model=MODEL, max_tokens=3, metadata={"tenant": "alice"}, lane="high")
    wait_for(lambda: mine in _cells(d, "#jobs td.job"), 60, "alice's finished job on the page")
    assert d.find_element(By.CSS_SELECTOR, f'#jobs tr[data-job="{mine}"] td.outcome').text == "length"
    # its first token reached the latency chart: the first-token series has a point (the workers' first_token events)
    wait_for(lambda: int(d.find_element(By.ID, "chart-latency").get_attribute("data-ttft-points") or 0) >= 1, 10,
             "a point on the first-token latency chart")

    # a queue: 12 long jobs on 2 engine slots drain for ~15 s; the page's depth is Redis's (it refreshes every 2 s)
    for i in range(12):
        producer.submit(prompt=f"long {i}", model=MODEL, max_tokens=120, metadata={"tenant": "alice"})

    def depth_matches() -> bool:
        page = _cells(d, f'#queues tr[data-model="{MODEL}"][data-lane="normal"] td.depth')
        return bool(page) and int(page[0]) == _redis_depth(r, "normal") > 0

    wait_for(depth_matches, 30, "the page's queue depth equal to Redis's")

    # the worker: its model, and its running count as its heartbeat hash says
    def worker_matches() -> bool:
        row = '#workers tr[data-worker="dash-worker"]'
        running = _cells(d, row + " td.running")
        beat = r.hgetall(keys.worker_hash("dash-worker"))
        return bool(running) and int(running[0]) == int(beat[b"num_running"]) == 2
    wait_for(worker_matches, 30, "the page's worker equal to its heartbeat")
    assert _cells(d, '#workers tr[data-worker="dash-worker"] td.model') == [MODEL]

    # the bulk: its progress as the bulk hash counts it, live, until done (6 of 6)
    bulk_ids = [x.decode() for x in r.zrange(keys.tenant_bulks_index("alice"), 0, -1)]
    assert bulk_ids == [batch.id]  # the Batch API's batch is the bulk the page shows
    bulk = bulk_ids[0]

    def bulk_matches(final: bool) -> bool:
        h = {k.decode(): v.decode() for k, v in r.hgetall(keys.bulk_hash(bulk)).items()}
        done = sum(int(h.get(f, 0)) for f in (BulkField.COMPLETED, BulkField.FAILED, BulkField.INVALID, BulkField.SKIPPED))
        page_done = _cells(d, f'#bulks li[data-bulk="{bulk}"] .done')
        page_total = _cells(d, f'#bulks li[data-bulk="{bulk}"] .total')
        return bool(page_done) and int(page_done[0]) == done and (not final or (done == int(page_total[0]) == 6))

    wait_for(lambda: bulk_matches(final=True), 180, "the page's bulk progress at 6 of 6, as Redis counts it")

    # the charts drew (uPlot's canvases), the tenant scoping held, and the browser logged no error
    assert len(d.find_elements(By.CSS_SELECTOR, ".chart canvas")) == 2
    wait_for(lambda: bob_job in _cells(d, "#jobs td.job") or producer.status(bob_job).is_final, 30, "bob's job final")
    time.sleep(2.5)  # a state refresh after it
    assert bob_job not in d.page_source and "bob's secret" not in d.page_source
    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors

    d.save_screenshot(str(shots / "dashboard-desktop.png"))
    d.set_window_size(*PHONE)
    time.sleep(1)
    # nothing wider than the phone's screen: the page scrolls down, not sideways (wide tables scroll in their box)
    assert d.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
    d.save_screenshot(str(shots / "dashboard-phone.png"))
    assert (shots / "dashboard-desktop.png").stat().st_size > 10_000 and (shots / "dashboard-phone.png").stat().st_size > 10_000

    # what each key's feed carries: bob sees his job, the admin sees both, alice only hers
    def state(key: str) -> str:
        return httpx.get(base + "/dashboard/api/state", headers={"Authorization": f"Bearer {key}"}, timeout=10).text
    assert bob_job in state(BOB) and mine not in state(BOB)
    assert bob_job in state(OPS) and mine in state(OPS)
    assert bob_job not in state(ALICE) and mine in state(ALICE)

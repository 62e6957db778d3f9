"""The engine core in a process of its own (``engine.engine_process``): the same outputs as
``LLMEngine`` in-process, bad input still refused at ``add_request``, and a core that dies
stops its worker, whose jobs another worker then finishes exactly."""
from __future__ import annotations

import os
import signal

import pytest

from pagestream.engine import EngineConfig, SamplingParams
from pagestream.engine.engine_process import EngineProcess
from pagestream.engine.errors import EngineDeadError
from pagestream.producer import JobStatus
from pagestream.producer.protocol import keys
from tests.queue_helpers import WorkerProc, assert_contiguous, engine_core_pid, pending_of, pid_alive, wait_for


def _drive(engine) -> dict:
    """A mix of every kind of request, an abort mid-run, and the outputs collected per sample."""
    eos_free = dict(ignore_eos=True)
    engine.add_request("greedy", prompt="The quick brown fox", params=SamplingParams(temperature=0, max_tokens=24, **eos_free))
    engine.add_request("seeded-n2", prompt="Once upon a time", params=SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=20, **eos_free))
    engine.add_request("stop-str", prompt="Count with me", params=SamplingParams(temperature=0.8, seed=3, max_tokens=40, stop=["e"], **eos_free))
    engine.add_chat_request("chat", [{"role": "user", "content": "Hello there"}], SamplingParams(temperature=0, max_tokens=12, **eos_free))
    engine.add_request("resumed", prompt_token_ids=[5, 6, 7, 8], resume_token_ids=[40, 41, 42],
                       params=SamplingParams(temperature=0.7, seed=11, max_tokens=16, **eos_free))
    engine.add_request("stop-n2", prompt="Two ways", params=SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=40,
                                                                           stop=["a", "o"], include_stop_str_in_output=True, **eos_free))
    engine.add_request("final-lp", prompt="Whole at once", params=SamplingParams(temperature=0.6, seed=9, max_tokens=10, logprobs=2,
                                                                                output_kind="final", stop=["zz"], **eos_free))
    engine.add_request("aborted", prompt="never mind", params=SamplingParams(temperature=0, max_tokens=200, **eos_free))
    got: dict = {}
    steps = 0
    aborted = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                s = got.setdefault((out.request_id, c.index), {"ids": [], "text": "", "fin": None, "lps": []})
                assert c.first_token_index == len(s["ids"]) + (3 if out.request_id == "resumed" else 0) or not c.token_ids
                s["ids"] += c.token_ids
                s["text"] += c.text
                s["fin"] = (c.finish_reason, c.stop_reason) if c.finish_reason else s["fin"]
                s["lps"] += [sorted(d) for d in c.logprobs or []]
        steps += 1
        if steps >= 3 and not aborted:
            aborted = engine.abort_request("aborted")
    return {k: (v["ids"], v["text"], v["fin"], v["lps"]) for k, v in got.items() if k[0] != "aborted"}, got[("aborted", 0)]["fin"]


def test_engine_process_gives_the_outputs_of_the_engine_in_process(tiny_llama_dir):
    from pagestream.engine import LLMEngine

    cfg = dict(model=tiny_llama_dir, device="cpu", max_num_seqs=8, max_model_len=256, seed=0)
    with EngineProcess(EngineConfig(**cfg)) as proc:
        assert proc.core_pid != os.getpid()
        remote, remote_abort = _drive(proc)
        assert proc.stats().num_generated_tokens > 0
        # bad input is refused at add_request, with the in-process engine's message, and nothing else stops
        with pytest.raises(ValueError, match="max_model_len"):
            proc.add_request("long", prompt_token_ids=[5] * 300)
        with pytest.raises(ValueError, match=r"integers in \[0, "):
            proc.add_request("bad-id", prompt_token_ids=[10**9])
        with pytest.raises(ValueError, match="max_num_seqs"):
            proc.add_request("many", prompt="hi", params=SamplingParams(n=9))
        proc.add_request("after", prompt="still serving", params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        after = [t for _ in range(200) if proc.has_unfinished_requests() for o in proc.step() for t in o.outputs[0].token_ids]
        assert len(after) == 4
    local, local_abort = _drive(LLMEngine(EngineConfig(**cfg)))
    assert remote == local
    assert remote_abort == local_abort == ("abort", None)
    assert remote[("stop-str", 0)][2] == ("stop", "e") and "e" not in remote[("stop-str", 0)][1]
    assert {remote[("stop-n2", i)][2][1] for i in (0, 1)} <= {"a", "o"}  # each sample stopped on its own
    assert len(remote[("final-lp", 0)][3]) == len(remote[("final-lp", 0)][0]) == 10


def test_a_core_that_cannot_start_says_why(tiny_llama_dir):
    with pytest.raises(ValueError, match="no room for a single KV block"):
        EngineProcess(EngineConfig(model=tiny_llama_dir, device="cpu", kv_cache_bytes=1))


@pytest.mark.slow
def test_a_dead_engine_core_stops_its_worker_and_another_finishes_its_jobs(r, redis_url, producer, tmp_path, tiny_llama_dir):
    specs = [{"job_id": f"core-{i}", "prompt": f"story {i}", "max_tokens": 64, "temperature": 0.8, "seed": i} for i in range(6)]
    wa = WorkerProc(redis_url, tiny_llama_dir, "core-a", "--max-num-seqs", "6", "--lease-ms", "1500", "--engine-process",
                    log_dir=tmp_path)
    wb = None
    try:
        wa.wait_ready()
        producer.submit_many(specs)
        wait_for(lambda: pending_of(r).get("core-a", 0) == 6 and all(r.xlen(keys.out_stream(s["job_id"])) for s in specs[:2]),
                 120, "worker a to run the jobs")
        core = engine_core_pid(wa)
        os.kill(core, signal.SIGKILL)  # an OOM-kill or a CUDA fault takes the core down
        assert wa.proc.wait(60) == 1
        assert "engine core process exited" in wa.log()
        assert "Traceback" not in wa.log()
        assert not pid_alive(core)
        # handed back on the way out: idle past the lease, so the next worker takes them at once
        wb = WorkerProc(redis_url, tiny_llama_dir, "core-b", "--max-num-seqs", "6", "--lease-ms", "1500", log_dir=tmp_path)
        from pagestream.engine import LLM

        llm = LLM(tiny_llama_dir, device="cpu", max_num_seqs=8, seed=0)
        for s in specs:
            res = producer.result(s["job_id"], timeout=180)
            expected = llm.generate([s["prompt"]], SamplingParams(max_tokens=64, temperature=0.8, seed=s["seed"]), use_tqdm=False)[0]
            assert res.status == JobStatus.COMPLETED and res.worker == "core-b", res
            assert (res.text, res.token_ids) == (expected.outputs[0].text, expected.outputs[0].token_ids), s["job_id"]
            assert assert_contiguous(r, s["job_id"]) == res.text
    finally:
        wa.stop(10)
        if wb is not None:
            wb.stop(10)


def test_iteration_tokens_are_each_steps_computed_tokens_in_process_and_in_the_engine_process(tiny_llama_dir):
    """What ``vllm:iteration_tokens_total`` observes (``take_iteration_tokens``): one count per step that ran, the
    prompts on their first step and one token per decoding sequence after, the same from the engine process."""
    from pagestream.engine import LLMEngine

    cfg = EngineConfig(model=tiny_llama_dir, device="cpu", max_num_seqs=4, max_model_len=256, seed=0,
                       async_scheduling=False, enable_prefix_caching=False)

    def drive(engine) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        engine.add_request("a", prompt_token_ids=[5, 6, 7, 8, 9, 10, 11], params=params)
        engine.add_request("b", prompt_token_ids=[12, 13, 14], params=params)
        taken: list[int] = []
        while engine.has_unfinished_requests():
            engine.step()
            taken += engine.take_iteration_tokens()
        return taken + engine.take_iteration_tokens()

    local = drive(LLMEngine(cfg))
    # step 1 prefills both prompts (7 + 3 tokens); steps 2-5 decode both (their tokens 2..5)
    assert local == [10, 2, 2, 2, 2]
    with EngineProcess(cfg) as proc:
        assert drive(proc) == local

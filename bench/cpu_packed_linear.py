"""oneDNN's packed weights for the CPU linear layers and the LM head (``CausalLM.pack_for_cpu``, which the engine
applies to every CPU model it loads), measured against MKL's F.linear on the plain weights: SmolLM2's four
projection kinds over 30 layers and its LM head at 10 rows; then SmolLM2 itself (10 greedy sequences x 48 tokens,
EOS ignored) packed (the engine's default) and after its weights are unpacked again in the same process, with the
tokens compared. Also whether a row's result is the same bit for bit whatever the batch it is in, for both.

    OMP_NUM_THREADS=1 .venv/bin/python bench/cpu_packed_linear.py
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from pagestream.engine.layers.parallel import pack_on_cpu, packed_linear


def bench(f, n: int) -> float:
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


def layers() -> None:
    rows = 10
    ws = [(torch.randn(960, 576), torch.randn(576, 576), torch.randn(3072, 576), torch.randn(576, 1536)) for _ in range(30)]
    x, h = torch.randn(rows, 576), torch.randn(rows, 1536)
    ins = (x, x, x, h)
    packed = [tuple(pack_on_cpu(w) for w in layer) for layer in ws]
    plain = bench(lambda: [F.linear(i, w) for layer in ws for w, i in zip(layer, ins)], 20)
    fast = bench(lambda: [packed_linear(i, w) for layer in packed for w, i in zip(layer, ins)], 20)
    print(f"projections of 30 layers, {rows} rows: F.linear {plain:.1f} ms, packed {fast:.1f} ms a step")
    head = torch.randn(49152, 576)
    packed_head = pack_on_cpu(head)
    w, packed_w, x40 = ws[0][2], packed[0][2], torch.randn(40, 576)
    whole_plain, whole_packed = F.linear(x40, w), packed_linear(x40, packed_w)
    sizes = range(1, 34)
    plain_same = [n for n in sizes if torch.equal(F.linear(x40[:n], w), whole_plain[:n])]
    packed_same = [n for n in sizes if torch.equal(packed_linear(x40[:n], packed_w), whole_packed[:n])]
    print(f"gate/up 3072 x 576, the first n of 40 rows alone equal to them in the batch of 40, n in 1-33: "
          f"F.linear {len(plain_same)}/33 (differs at n = {[n for n in sizes if n not in plain_same]}), "
          f"packed {len(packed_same)}/33")
    print(f"LM head 49152 x 576, {rows} rows: F.linear {bench(lambda: F.linear(x, head), 20):.1f} ms, "
          f"packed {bench(lambda: packed_linear(x, packed_head), 20):.1f} ms")


@torch.no_grad()
def unpack(model) -> int:
    """Back to plain weights and F.linear (the engine before it packed)."""
    n = 0
    for m in model.modules():
        if getattr(m, "packed_weight", None) is not None:
            m.weight = torch.nn.Parameter(m.packed_weight.to_dense(), requires_grad=False)
            m.packed_weight = None
            n += 1
    if model.packed_output_embedding is not None:
        if model.lm_head is not None:
            model.lm_head.weight = torch.nn.Parameter(model.packed_output_embedding.to_dense(), requires_grad=False)
        model.packed_output_embedding = None
        n += 1
    return n


def smollm2() -> None:
    from pagestream.engine import LLM, SamplingParams
    from pagestream.engine.smollm2 import ensure_smollm2

    llm = LLM(str(ensure_smollm2()), device="cpu")
    prompts = [f"Explain topic number {i} in a few sentences please." for i in range(10)]
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)

    def run():
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]

    (a1, toks), (a2, _) = run(), run()
    n = unpack(llm.llm_engine.runner.model)
    (b1, toks2), (b2, _) = run(), run()
    print(f"SmolLM2, 10 x 48 tokens: packed {a1:.2f} / {a2:.2f} s, plain F.linear ({n} weights unpacked) "
          f"{b1:.2f} / {b2:.2f} s; same tokens: {toks == toks2}")


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    layers()
    smollm2()

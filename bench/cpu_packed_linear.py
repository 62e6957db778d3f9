"""oneDNN's packed weights for the CPU linear layers, measured (not used by the engine): SmolLM2's four projection
kinds over 30 layers at 10 rows, F.linear against ``torch.ops.mkldnn._linear_pointwise`` on weights packed with
``_reorder_linear_weight``; then SmolLM2 itself (10 greedy sequences x 48 tokens, EOS ignored) before and after its
projections are swapped to packed weights in the same process, with the tokens compared.

    OMP_NUM_THREADS=1 .venv/bin/python bench/cpu_packed_linear.py
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F


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
    packed = [tuple(torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in layer) for layer in ws]
    plain = bench(lambda: [F.linear(i, w) for layer in ws for w, i in zip(layer, ins)], 20)
    fast = bench(lambda: [torch.ops.mkldnn._linear_pointwise(i, w, None, "none", [], "") for layer in packed
                          for w, i in zip(layer, ins)], 20)
    print(f"projections of 30 layers, {rows} rows: F.linear {plain:.1f} ms, packed {fast:.1f} ms a step")


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
    mods = [m for m in llm.llm_engine.runner.model.modules() if type(m).__name__ in ("ColumnParallelLinear", "RowParallelLinear")]
    for m in mods:
        m._packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), 16)
        m.forward = lambda x, m=m: torch.ops.mkldnn._linear_pointwise(x, m._packed, m.bias, "none", [], "")
    (b1, toks2), (b2, _) = run(), run()
    print(f"SmolLM2, 10 x 48 tokens: F.linear {a1:.2f} / {a2:.2f} s, packed ({len(mods)} layers) {b1:.2f} / {b2:.2f} s; "
          f"same tokens: {toks == toks2}")


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    layers()
    smollm2()

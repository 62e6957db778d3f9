"""The CPU reference's decode attention against an earlier version of it, alternately, one thread.

    git show 40e7d5d:kernels/reference.py > /tmp/ref_old.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/cpu_decode_attention.py [/tmp/ref_old.py]

10 sequences of 250-320 tokens in 16-token blocks, SmolLM2-135M's attention shape (9 query heads, 3 KV heads,
head_dim 64): one layer's decode attention, microseconds a call, 6 rounds of 300 calls each.
"""
import torch, time, importlib.util, sys
from pagestream.kernels import reference as R
spec = importlib.util.spec_from_file_location("ref_old", sys.argv[1] if len(sys.argv) > 1 else "/tmp/ref_old.py"); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
torch.manual_seed(0)
S, H, KVH, D, BS, T = 10, 9, 3, 64, 16, 320
nb_per = T // BS; NB = S * nb_per + 8
kc = torch.randn(NB, BS, KVH, D); vc = torch.randn(NB, BS, KVH, D)
bt = torch.randperm(NB)[: S * nb_per].view(S, nb_per).to(torch.int32)
ctx = torch.randint(250, T + 1, (S,), dtype=torch.int32)
q = torch.randn(S, H, D); scale = D ** -0.5
print("maxdiff", (old.paged_decode_attention(q, kc, vc, bt, ctx, scale) - R.paged_decode_attention(q, kc, vc, bt, ctx, scale)).abs().max().item())
for rnd in range(6):
    for name, fn in (("old", old.paged_decode_attention), ("new", R.paged_decode_attention)):
        for _ in range(5): fn(q, kc, vc, bt, ctx, scale)
        t = time.perf_counter()
        for _ in range(300): fn(q, kc, vc, bt, ctx, scale)
        print(rnd, name, round((time.perf_counter() - t) / 300 * 1e6), "us")

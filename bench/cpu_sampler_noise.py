"""The sampler's noise on the CPU for a mixed batch (4 greedy rows, 4 seeded rows at temperature 0.8, SmolLM2's
vocabulary of 49,152): what the sampler drew before (a vocabulary of exponentials for every row, then each seeded
row's own again) against ``Sampler._sample`` now (only each seeded row's own), in the same process.

    OMP_NUM_THREADS=1 .venv/bin/python bench/cpu_sampler_noise.py
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from cpu_packed_linear import bench  # bench/ is on sys.path when run as a script
from pagestream.engine.sampler import Sampler, seeded_draw_seed

ROWS, VOCAB = 8, 49152


def main() -> None:
    sampler = Sampler(VOCAB, {2}, seed=0, device=torch.device("cpu"))
    greedy = [i % 2 == 0 for i in range(ROWS)]
    seqs = [SimpleNamespace(params=SimpleNamespace(temperature=0.0 if g else 0.8, top_k=0, top_p=1.0, min_p=0.0,
                                                   seed=None if g else 1000 + i),
                            sample_index=0, num_planned_output_tokens=5) for i, g in enumerate(greedy)]
    logits = torch.randn(ROWS, VOCAB)
    seeded_gen = torch.Generator()

    def old_noise():
        noise = torch.empty(ROWS, VOCAB).exponential_(generator=sampler.generator)
        for i, s in enumerate(seqs):
            if not greedy[i]:
                seeded_gen.manual_seed(seeded_draw_seed(s.params.seed, 0, 5))
                noise[i].exponential_(generator=seeded_gen)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {ROWS} rows x {VOCAB}")
    print(f"before: the noise alone (every row, then each seeded row's own) {bench(old_noise, 50):.2f} ms")
    print(f"now: Sampler._sample whole (temperature, softmax, each seeded row's noise, argmax) "
          f"{bench(lambda: sampler._sample(logits, seqs, greedy), 50):.2f} ms")


if __name__ == "__main__":
    main()

"""Whole-output decodes as the engine pays them when a batch's samples finish: 32 outputs of 256 token ids,
through transformers' decode(), its _decode(), the Rust backend's decode, and the backend's decode_batch.

    cd /tmp && python3 /path/to/bench/tokenizer_decode.py [TOKENIZER_DIR]   # default: throughput.py's 1B bench tokenizer

Run it outside the repository root: transformers probes for a package named `kernels`, and the root holds one.
"""
import random
import sys
import timeit

from transformers import AutoTokenizer


def main(path: str) -> None:
    import tokenizers
    import transformers

    tok = AutoTokenizer.from_pretrained(path)
    print(transformers.__version__, tokenizers.__version__, type(tok).__name__, tok.clean_up_tokenization_spaces)
    rng = random.Random(0)
    seqs = [[rng.randrange(3, tok.vocab_size) for _ in range(256)] for _ in range(32)]
    be = tok.backend_tokenizer
    for name, f in [("decode", lambda: [tok.decode(s) for s in seqs]), ("_decode", lambda: [tok._decode(s) for s in seqs]),
                    ("backend", lambda: [be.decode(s) for s in seqs]), ("batch", lambda: be.decode_batch(seqs))]:
        print(name, round(timeit.timeit(f, number=20) / 20 * 1e3, 3), "ms per 32")
    print("_decode equals the backend's decode:", tok._decode(seqs[0]) == be.decode(seqs[0]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/pagestream-tput-llama-3.2-1b")

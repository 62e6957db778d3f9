"""The tokenizer and end-of-sequence ids of a model directory, loaded the same way by the in-process
engine and by ``EngineProcess``'s side of an engine core."""
from __future__ import annotations

import json
import os

from pagestream.engine.config import EngineConfig


def load_tokenizer(path: str):
    """The model directory's tokenizer (transformers'; no torch), or None when it has none."""
    if not (os.path.isfile(os.path.join(path, "tokenizer.json")) or os.path.isfile(os.path.join(path, "tokenizer_config.json"))):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(config: EngineConfig, tokenizer) -> set[int]:
    """Every id that ends a sample at EOS: the model config's, generation_config.json's, the tokenizer's."""
    ids: set[int] = set()
    gen_file = os.path.join(config.model, "generation_config.json")
    sources = [config.hf_config.get("eos_token_id")]
    if os.path.isfile(gen_file):
        sources.append(json.loads(open(gen_file).read()).get("eos_token_id"))
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for src in sources:
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list):
            ids.update(i for i in src if isinstance(i, int))
    return ids

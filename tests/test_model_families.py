"""Model families beyond the parity runs (tests/test_engine_parity.py): the registry's refusal
of unknown architectures, evidence that each family's quirk is live (turning it off breaks
parity with HF), OPT without a chat template, and models named by hub id, resolved from a
local Hugging Face cache laid out as huggingface_hub writes it (no network).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagestream.engine import LLM, SamplingParams
from pagestream.engine.config import EngineConfig
from pagestream.engine.models.registry import SUPPORTED_ARCHITECTURES
from test_engine_parity import MAX_TOKENS, HFReference, varied_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def test_unknown_architecture_is_refused_with_the_supported_list(tiny_llama_dir, tmp_path):
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        EngineConfig(model=str(tmp_path / "m"))
    msg = str(err.value)
    assert "FalconForCausalLM" in msg and "none of which is supported" in msg
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma2ForCausalLM", "OPTForCausalLM"):
        assert arch in SUPPORTED_ARCHITECTURES and arch in msg


# (fixture, hf_overrides that switch the family's quirk off)
QUIRKS = [
    ("tiny_mistral_dir", {"sliding_window": None}),
    ("tiny_gemma2_dir", {"attn_logit_softcapping": None}),
    ("tiny_gemma2_dir", {"sliding_window": None}),
    ("tiny_gemma2_dir", {"query_pre_attn_scalar": 16}),
]


@pytest.mark.parametrize("model_fixture,quirk_off", QUIRKS, ids=lambda v: v if isinstance(v, str) else next(iter(v)))
def test_each_quirk_changes_the_tokens(model_fixture, quirk_off, request):
    """The parity runs would pass vacuously if a quirk never mattered on these shapes: with it
    switched off, the engine must leave HF's tokens on some prompt."""
    model_dir = request.getfixturevalue(model_fixture)
    hf = HFReference(model_dir)
    prompts = varied_prompts()[::2]
    outs = LLM(model_dir, device="cpu", hf_overrides=quirk_off).generate(prompts, GREEDY, use_tqdm=False)
    differing = sum(out.outputs[0].token_ids != hf.greedy(p)[0] for p, out in zip(prompts, outs))
    assert differing >= 1, f"{quirk_off} made no difference on {len(prompts)} prompts"


def test_gemma2_final_logits_are_soft_capped_as_hf(tiny_gemma2_dir):
    # tanh is monotonic, so greedy tokens cannot see the final cap: the logits themselves are checked
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma2_dir, dtype=torch.float32).eval()
    ours = LLM(tiny_gemma2_dir, device="cpu", num_kv_blocks=16).llm_engine.runner.model
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)) * 30
    cap = hf.config.final_logit_softcapping
    with torch.no_grad():
        want = torch.tanh(hf.lm_head(hidden) / cap) * cap
        got = ours.compute_logits(hidden)
    assert got.abs().max() <= cap and (hf.lm_head(hidden).abs().max() > cap)
    torch.testing.assert_close(got, want)


def test_opt_has_no_chat_template_and_says_so(tiny_opt_dir):
    llm = LLM(tiny_opt_dir, device="cpu", num_kv_blocks=16)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
    assert llm.generate("plain prompts work", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


# ------------------------------------------------------------------ hub ids from a local cache

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(cache: Path, repo_id: str, src: str, commit: str = COMMIT, tags: tuple[str, ...] = ()) -> None:
    """Lay ``src`` out as huggingface_hub's cache does: content-addressed blobs, a snapshot of
    relative symlinks per commit, refs/main (and tags) naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in sorted(os.listdir(src)):
        data = Path(src, name).read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob))
    (repo / "refs").mkdir()
    for ref in ("main", *tags):
        (repo / "refs" / ref).write_text(commit)


RESOLVE_SCRIPT = r"""
import json, sys
from pagestream.engine import LLM, SamplingParams
from pagestream.engine.config import EngineConfig
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = {"dir": EngineConfig(model=name).model}
    except ValueError as exc:
        out[name] = {"error": str(exc)}
llm = LLM(sys.argv[1], device="cpu", num_kv_blocks=32)
res = llm.generate(["the quick brown fox", "seven wizards"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
out["tokens"] = [r.outputs[0].token_ids for r in res]
print(json.dumps(out))
"""


def test_hub_ids_resolve_from_a_local_cache_offline(tiny_opt_dir, tmp_path):
    cache = tmp_path / "hub"
    write_hub_cache(cache, "pagestream-tests/tiny-opt", tiny_opt_dir, tags=("v1",))
    names = ["pagestream-tests/tiny-opt", f"pagestream-tests/tiny-opt@{COMMIT}", "pagestream-tests/tiny-opt@v1",
             "pagestream-tests/no-such-model", "pagestream-tests/tiny-opt@v9", "not//a valid id"]
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", RESOLVE_SCRIPT, *names], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    snapshot = cache / "models--pagestream-tests--tiny-opt" / "snapshots" / COMMIT
    for name in names[:3]:
        assert Path(got[name]["dir"]) == snapshot, got[name]
    for name in names[3:5]:
        err = got[name]["error"]
        assert name in err and "not in the Hugging Face cache" in err and "HF_HUB_OFFLINE" in err, err
    assert "unknown model" in got[names[5]]["error"] and "hub id" in got[names[5]]["error"]
    # the model named by hub id is the same model as its directory
    local = LLM(tiny_opt_dir, device="cpu", num_kv_blocks=32).generate(
        ["the quick brown fox", "seven wizards"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert got["tokens"] == [r.outputs[0].token_ids for r in local]

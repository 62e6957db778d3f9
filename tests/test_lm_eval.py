"""Issue 24, acceptance 2: lm-evaluation-harness against ``pagestream serve`` on SmolLM2 (fp32 on the CPU),
compared with lm-eval's ``hf`` backend (greedy HF transformers) on the same model and tasks.

- ``local-completions`` scores a small local multiple-choice task (loglikelihood: echo, max_tokens=1,
  logprobs=1 over token-id prompts): accuracy and per-choice loglikelihoods equal the ``hf`` backend's.
- ``local-completions`` runs a small generate-until task (two-shot, ``until: ["\\n"]``, a few tokens, greedy):
  every generation and the exact-match score equal the ``hf`` backend's.
- ``local-chat-completions`` runs the same generate-until task with the chat template (few-shot as
  multi-turn): every generation and the score equal the ``hf`` backend's with ``apply_chat_template``.
  Chat runs no loglikelihood task: lm-eval's ``local-chat-completions`` refuses loglikelihood requests
  itself (a chat endpoint returns no prompt logprobs in OpenAI's API), so that is lm-eval's limit, not
  the server's.
"""
from __future__ import annotations

import json

import pytest
import redis

from gateway_helpers import ServeProc
from test_gateway import DB_URL

pytestmark = pytest.mark.slow

ROWS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Berlin", "Madrid", "Rome"], "answer": 0},
    {"question": "How many legs does a spider have?", "choices": ["six", "eight", "ten", "four"], "answer": 1},
    {"question": "Which planet is known as the red planet?", "choices": ["Venus", "Jupiter", "Mars", "Saturn"],
     "answer": 2},
    {"question": "What do bees make?", "choices": ["milk", "silk", "wool", "honey"], "answer": 3},
    {"question": "What is frozen water called?", "choices": ["ice", "steam", "sand", "glass"], "answer": 0},
    {"question": "Which animal barks?", "choices": ["cat", "dog", "fish", "bird"], "answer": 1},
]

TASK = """task: pagestream_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""

#: two shots (the train split, taken in order) teach the short-answer form; the test split's questions are
#: ones SmolLM2-135M answers right for some and wrong for others, so an equal score means something
GEN_SHOTS = [
    {"question": "What is the capital of Germany?", "answer": "Berlin"},
    {"question": "How many wheels does a bicycle have?", "answer": "two"},
]
GEN_ROWS = [
    {"question": "What is the capital of France?", "answer": "Paris"},
    {"question": "How many legs does a spider have?", "answer": "eight"},
    {"question": "Which planet is known as the red planet?", "answer": "Mars"},
    {"question": "What do bees make?", "answer": "honey"},
    {"question": "What is frozen water called?", "answer": "ice"},
    {"question": "Which animal barks?", "answer": "dog"},
]
MAX_GEN_TOKS = 8

GEN_TASK = """task: pagestream_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    train: {shots}
    test: {data}
test_split: test
fewshot_split: train
num_fewshot: 2
fewshot_config:
  sampler: first_n
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
fewshot_delimiter: "\\n\\n"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
  temperature: 0.0
filter_list:
  - name: strip
    filter:
      - function: remove_whitespace
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm-eval-task")
    data = d / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (d / "pagestream_tiny_mc.yaml").write_text(TASK.format(data=data))
    shots, gen = d / "gen_shots.jsonl", d / "gen_data.jsonl"
    shots.write_text("".join(json.dumps(r) + "\n" for r in GEN_SHOTS))
    gen.write_text("".join(json.dumps(r) + "\n" for r in GEN_ROWS))
    (d / "pagestream_tiny_gen.yaml").write_text(GEN_TASK.format(shots=shots, data=gen, max_gen_toks=MAX_GEN_TOKS))
    return d


@pytest.fixture(scope="module")
def serve(smollm2_dir, tmp_path_factory):
    """``pagestream serve`` starting; call the fixture's value to wait until it answers (its /v1 URL)."""
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    serve = ServeProc(smollm2_dir, "--served-model-name", "smollm2", "--max-num-seqs", "4", log_dir=tmp_path_factory.mktemp("serve"))

    def ready() -> str:
        serve.wait_ready()
        return serve.base_url

    try:
        yield ready
    finally:
        serve.stop()
        r.flushdb()


def _evaluate(model: str, model_args: dict, task_dir, task: str = "pagestream_tiny_mc", **kwargs) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    # only this directory's tasks: indexing lm-eval's thousands of built-in ones costs seconds per call
    tasks = TaskManager(include_path=str(task_dir), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], task_manager=tasks,
                                   log_samples=True, batch_size=1, random_seed=0, numpy_random_seed=0,
                                   torch_random_seed=0, **kwargs)


def _hf(smollm2_dir) -> dict:
    return {"pretrained": str(smollm2_dir), "dtype": "float32", "device": "cpu"}


def _generations(out: dict, task: str = "pagestream_tiny_gen") -> list[str]:
    """Each doc's generation as lm-eval received it (before the task's filters), in doc order."""
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return [s["resps"][0][0] for s in samples]


def _loglikelihoods(out: dict) -> list[list[float]]:
    samples = sorted(out["samples"]["pagestream_tiny_mc"], key=lambda s: s["doc_id"])
    return [[float(r[0]) for r in s["filtered_resps"]] for s in samples]


def test_lm_eval_local_completions_equals_the_hf_backend(serve, smollm2_dir, task_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    # the hf backend runs while serve starts
    hf = _evaluate("hf", _hf(smollm2_dir), task_dir)
    served = serve()
    api = _evaluate("local-completions", {"base_url": f"{served}/completions", "model": "smollm2",
                                          "tokenizer": str(smollm2_dir), "tokenizer_backend": "huggingface",
                                          "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1}, task_dir)
    api_acc = api["results"]["pagestream_tiny_mc"]["acc,none"]
    hf_acc = hf["results"]["pagestream_tiny_mc"]["acc,none"]
    assert api_acc == hf_acc > 0.25  # and better than chance: the scores mean something
    got, want = _loglikelihoods(api), _loglikelihoods(hf)
    assert len(got) == len(ROWS)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-3)


def _check_generate_until(api: dict, hf: dict) -> None:
    got, want = _generations(api), _generations(hf)
    assert len(got) == len(GEN_ROWS)
    assert all(g.strip() for g in got)  # the model answered each question: a score of empty strings means nothing
    assert got == want  # greedy: the server's stop and length handling cut where transformers' generate + lm-eval do
    api_em = api["results"]["pagestream_tiny_gen"]["exact_match,strip"]
    hf_em = hf["results"]["pagestream_tiny_gen"]["exact_match,strip"]
    assert api_em == hf_em
    assert 0 < api_em < 1  # some right, some wrong: the metric discriminates


def test_lm_eval_local_completions_generate_until_equals_the_hf_backend(serve, smollm2_dir, task_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    hf = _evaluate("hf", _hf(smollm2_dir), task_dir, "pagestream_tiny_gen")
    served = serve()
    api = _evaluate("local-completions", {"base_url": f"{served}/completions", "model": "smollm2",
                                          "tokenizer": str(smollm2_dir), "tokenizer_backend": "huggingface",
                                          "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1,
                                          "max_gen_toks": MAX_GEN_TOKS}, task_dir, "pagestream_tiny_gen")
    _check_generate_until(api, hf)
    # the until string ends every answer that did not end with the model's EOS: the server stopped there, and
    # left the stop string out (OpenAI's rule; lm-eval would otherwise carry the rest of the next question)
    assert not any("\n" in g for g in _generations(api))


def test_lm_eval_local_chat_completions_generate_until_equals_the_hf_backend(serve, smollm2_dir, task_dir,
                                                                            monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    chat = {"apply_chat_template": True, "fewshot_as_multiturn": True}
    hf = _evaluate("hf", _hf(smollm2_dir), task_dir, "pagestream_tiny_gen", **chat)
    served = serve()
    api = _evaluate("local-chat-completions", {"base_url": f"{served}/chat/completions", "model": "smollm2",
                                               "num_concurrent": 1, "max_retries": 1, "max_gen_toks": MAX_GEN_TOKS},
                    task_dir, "pagestream_tiny_gen", **chat)
    _check_generate_until(api, hf)
    # lm-eval sent the shots as turns: the request the server templated was a chat, not one flat string
    args = sorted(api["samples"]["pagestream_tiny_gen"], key=lambda s: s["doc_id"])[0]["arguments"]
    assert '"role": "assistant"' in str(args)

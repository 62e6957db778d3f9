"""An instant engine with LLMEngine's interface, for queue tests and the queue benchmark.

Outputs are a pure function of (prompt, seed, sample index, token index), so a
job resumed with ``resume_token_ids`` continues exactly like the uninterrupted
run, as the real engine promises for seeded requests. KV blocks are accounted
like a paged cache (``block_size`` tokens per block) so backpressure through
``num_admittable()`` behaves like the real thing. ``step_delay_s`` makes a step
take time (to kill a worker mid-job in tests). Logprobs, when asked for, are a pure
function of the same position too (``expected_logprobs``).
"""
from __future__ import annotations

import hashlib
import time
import zlib
from dataclasses import dataclass, field

from pagestream.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from pagestream.engine.sampling_params import SamplingParams


@dataclass
class FakeConfig:
    model: str = "fake"
    max_num_seqs: int = 8
    max_model_len: int = 512
    vocab_size: int = 50_001  # FakeTokenizer's ids are 1..50000
    block_size: int = 16
    num_blocks: int = 4096
    step_delay_s: float = 0.0


class FakeTokenizer:
    """Whitespace tokenizer: a word's id is a stable hash; id k decodes to ``"<k>"``."""

    eos_token_id = 0

    bos_token_id = 0  # the one special token: add_special_tokens puts it in front

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [zlib.crc32(w.encode()) % 50_000 + 1 for w in text.split()]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"<{i}>" for i in ids]

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list[dict] | None = None,
                            chat_template: str | None = None, **template_kwargs):
        if chat_template is not None:  # a request's own template: rendered as transformers does, sandboxed
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            text = ImmutableSandboxedEnvironment().from_string(chat_template).render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs)
            return self.encode(text) if tokenize else text
        text = " ".join(f"{m['role']}: {m['content']}" for m in messages)
        if tools:
            text = "tools: " + " ".join(t["function"]["name"] for t in tools) + " " + text
        if add_generation_prompt:
            text += " assistant:"
        return self.encode(text) if tokenize else text


@dataclass
class _Req:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    key: int
    outputs: list[list[int]]
    blocks: int
    priority: int = 0
    done: list[bool] = field(default_factory=list)
    started: bool = False
    prompt_logprobs_sent: bool = False
    prefilled: bool = False  # its first step ran (that step computed the prompt)


class FakeEngine:
    def __init__(self, config: FakeConfig | None = None) -> None:
        self.config = config or FakeConfig()
        self.tokenizer = FakeTokenizer()
        self._running: dict[str, _Req] = {}
        self._waiting: dict[str, _Req] = {}
        self._used_blocks = 0
        self._num_generated = 0
        self._pending_errors: list[RequestOutput] = []
        self._iteration_tokens: list[int] = []

    # -- the LLMEngine interface -------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        resume_token_ids: list[int] | None = None,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str | None = None,
    ) -> None:
        params = params or SamplingParams()
        if request_id in self._running or request_id in self._waiting:
            raise ValueError(f"request {request_id!r} already exists")
        ids = list(prompt_token_ids) if prompt_token_ids is not None else self.tokenizer.encode(prompt or "")
        if truncate_prompt_tokens is not None:  # as the real engine: right after tokenizing, -1 is the context
            k = self.config.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            if not 0 < k <= self.config.max_model_len:
                raise ValueError(f"truncate_prompt_tokens value ({truncate_prompt_tokens}) is greater than max_model_len "
                                 f"({self.config.max_model_len}). Please, select a smaller truncation size.")
            ids = ids[:k] if truncation_side == "right" else ids[max(0, len(ids) - k):]
        if not ids:
            raise ValueError("prompt is empty")
        max_new = params.max_tokens or (self.config.max_model_len - len(ids))
        if len(ids) + max_new > self.config.max_model_len:
            raise ValueError(  # vLLM's words, as the real engine's
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_new}. This model's maximum context length is "
                f"{self.config.max_model_len} tokens and your request has {len(ids)} input tokens "
                f"(prompt ({len(ids)} tokens) + max_tokens ({max_new}) exceeds max_model_len ({self.config.max_model_len}))"
            )
        seed = params.seed if params.seed is not None else int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little")
        key = zlib.crc32(repr((ids, seed)).encode())
        outputs = [[] for _ in range(params.n)]
        if resume_token_ids:
            outputs[0] = list(resume_token_ids)
        blocks = -(-(len(ids) + max_new) // self.config.block_size) * params.n
        self._waiting[request_id] = _Req(request_id, ids, params, key, outputs, blocks, priority, [False] * params.n)

    def add_chat_request(self, request_id: str, messages: list[dict], params: SamplingParams | None = None,
                         tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
                         continue_final_message: bool = False, chat_template: str | None = None,
                         chat_template_kwargs: dict | None = None, **kw) -> None:
        try:
            prompt = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                        continue_final_message=continue_final_message,
                                                        chat_template=chat_template, **(chat_template_kwargs or {}))
        except Exception as exc:  # as the real engine: a template that cannot render fails its request alone
            raise ValueError(f"the chat template failed to render: {type(exc).__name__}: {exc}") from exc
        self.add_request(request_id, prompt=prompt, params=params, **kw)

    def abort_request(self, request_id: str) -> None:
        req = self._running.pop(request_id, None) or self._waiting.pop(request_id, None)
        if req is not None and req.started:
            self._used_blocks -= req.blocks

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting or self._pending_errors)

    def num_admittable(self) -> int:
        free_seqs = self.config.max_num_seqs - len(self._running) - len(self._waiting)
        return max(0, free_seqs)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_free_blocks=self.config.num_blocks - self._used_blocks,
            num_total_blocks=self.config.num_blocks,
            kv_usage=self._used_blocks / self.config.num_blocks,
            kv_waste=0.0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
            num_generated_tokens=self._num_generated,
        )

    def take_iteration_tokens(self) -> list[int]:
        """The tokens each step since the last call computed (``LLMEngine.take_iteration_tokens``)."""
        taken, self._iteration_tokens = self._iteration_tokens, []
        return taken

    def step(self) -> list[RequestOutput]:
        if self.config.step_delay_s:
            time.sleep(self.config.step_delay_s)
        for rid in sorted(self._waiting, key=lambda r: self._waiting[r].priority):
            req = self._waiting[rid]
            if self._used_blocks + req.blocks > self.config.num_blocks:
                break
            del self._waiting[rid]
            req.started = True
            self._used_blocks += req.blocks
            self._running[rid] = req
        outs: list[RequestOutput] = []
        # the tokens this step computes, as the real engine counts them: a request's first step its prompt (and
        # any resumed tokens), each later step one per sample still going
        computed = 0
        for req in self._running.values():
            computed += sum(not d for d in req.done) if req.prefilled else len(req.prompt_token_ids) + sum(map(len, req.outputs))
            req.prefilled = True
        if computed:
            self._iteration_tokens.append(computed)
        for rid, req in list(self._running.items()):
            deltas = []
            for s, toks in enumerate(req.outputs):
                if req.done[s]:
                    continue
                k = len(toks)
                tok = self._token(req.key, s, k)
                toks.append(tok)
                self._num_generated += 1
                finish = None
                # no max_tokens: until the context is full, as the real engine does
                if len(toks) >= (req.params.max_tokens or self.config.max_model_len - len(req.prompt_token_ids)):
                    finish = "length"
                    req.done[s] = True
                lps = None if req.params.logprobs is None else [self._logprobs(req.key, s, k, req.params.logprobs)]
                deltas.append(CompletionOutput(index=s, text=f"<{tok}>", token_ids=[tok], first_token_index=k, finish_reason=finish,
                                               logprobs=lps))
            finished = all(req.done)
            if finished:
                del self._running[rid]
                self._used_blocks -= req.blocks
            prompt_lps = None
            if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:  # with the first output
                req.prompt_logprobs_sent = True
                prompt_lps = self.expected_prompt_logprobs(req.prompt_token_ids, req.params.prompt_logprobs)
            outs.append(RequestOutput(rid, None, req.prompt_token_ids, deltas, finished, prompt_logprobs=prompt_lps))
        return outs

    @staticmethod
    def expected_prompt_logprobs(prompt_token_ids: list[int], k: int) -> list[dict[int, float] | None]:
        """The engine's prompt logprobs for a prompt (a pure function of its tokens): None for the first, then
        the prompt's token at -j/100 and k alternatives below it."""
        out: list[dict[int, float] | None] = [None]
        for j, tok in enumerate(prompt_token_ids[1:], start=1):
            d = {tok % 50_000 + 1 + i: -j / 100 + 0.001 * (k - i) for i in range(k)}  # more likely than the prompt's
            d[tok] = -j / 100
            out.append(d)
        return out

    @staticmethod
    def _token(key: int, sample: int, index: int) -> int:
        return zlib.crc32(f"{key}:{sample}:{index}".encode()) % 50_000 + 1

    @classmethod
    def _logprobs(cls, key: int, sample: int, index: int, k: int) -> dict[int, float]:
        """The engine's shape: {token_id: logprob} of the top k and the sampled token (here the most likely)."""
        tok = cls._token(key, sample, index)
        lp0 = -((zlib.crc32(f"lp:{key}:{sample}:{index}".encode()) % 1000) + 1) / 1000
        out = {tok: lp0}
        for j in range(1, k):
            out.setdefault(tok % 50_000 + j, lp0 - j)
        return out

    def expected_logprobs(self, prompt: str, seed: int, max_tokens: int, k: int, sample: int = 0) -> list[dict[int, float]]:
        """The logprobs a seeded request with ``logprobs=k`` yields (for tests)."""
        key = zlib.crc32(repr((self.tokenizer.encode(prompt), seed)).encode())
        return [self._logprobs(key, sample, i, k) for i in range(max_tokens)]

    def expected_text(self, prompt: str, seed: int, max_tokens: int, sample: int = 0) -> str:
        """What a seeded request yields (for tests)."""
        key = zlib.crc32(repr((self.tokenizer.encode(prompt), seed)).encode())
        return "".join(f"<{self._token(key, sample, k)}>" for k in range(max_tokens))

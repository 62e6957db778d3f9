"""A request's input checked and tokenized before it reaches the scheduler (plain Python, no torch).

``LLMEngine`` runs it in its own process; an engine in another process (``engine.engine_process``)
runs it on the caller's side, so a bad request still raises ``ValueError`` at ``add_request``
and tokenization never takes time from the process that drives the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagestream.engine.sampling_params import SamplingParams

#: the arguments of ``apply_chat_template`` itself, which ``chat_template_kwargs`` may not set (the producer's
#: ``producer.protocol.chat_template.RESERVED_TEMPLATE_ARGS`` is the same list; the engine imports no producer code)
RESERVED_TEMPLATE_ARGS = ("messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                          "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
                          "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                          "tokenizer_kwargs")


@dataclass(slots=True)
class EngineLimits:
    """What a request is checked against: the engine's sizes once its KV pool is known."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool


class InputProcessor:
    def __init__(self, tokenizer: Any, limits: EngineLimits, model: str) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.model = model

    def tokenize(self, prompt: str | None, prompt_token_ids: list[int] | None, truncate_prompt_tokens: int | None = None,
                 truncation_side: str | None = None) -> list[int]:
        """The prompt's ids (a text prompt encoded), truncated as asked, then checked against the vocabulary."""
        vocab = self.limits.vocab_size
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("a request needs a prompt or prompt_token_ids")
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise ValueError(f"model {self.model} has no tokenizer: pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = self.truncate(list(prompt_token_ids), truncate_prompt_tokens, truncation_side)
        if not ids:
            raise ValueError("the prompt is empty: it must have at least 1 token")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        return ids

    def truncate(self, ids: list[int], truncate_prompt_tokens: int | None, truncation_side: str | None) -> list[int]:
        """vLLM's ``truncate_prompt_tokens`` on a tokenized prompt: its last k tokens (``truncation_side="right"``:
        its first k); -1: ``max_model_len`` of them; 0, below -1 or above ``max_model_len``: ValueError."""
        k = truncate_prompt_tokens
        if k is None:
            return ids
        max_len = self.limits.max_model_len
        if isinstance(k, bool) or not isinstance(k, int) or k == 0 or k < -1:
            raise ValueError(f"truncate_prompt_tokens must be -1 (the model's context length) or at least 1, got {k!r}")
        if truncation_side not in (None, "left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {truncation_side!r}")
        if k > max_len:  # vLLM's sentence
            raise ValueError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({max_len}). "
                             "Please, select a smaller truncation size.")
        k = max_len if k == -1 else k
        if len(ids) <= k:
            return ids
        return ids[:k] if truncation_side == "right" else ids[len(ids) - k:]

    def process(
        self,
        prompt: str | None,
        params: SamplingParams | None,
        prompt_token_ids: list[int] | None,
        resume_token_ids: list[int] | None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str | None = None,
    ) -> tuple[list[int], list[int], SamplingParams]:
        """(prompt ids, resumed output ids, params) of a request the engine can run; ValueError otherwise. The
        prompt is truncated (``truncate``) right after it is tokenized, before its ids and length are checked."""
        lim = self.limits
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self.tokenize(prompt, prompt_token_ids, truncate_prompt_tokens, truncation_side)
        max_len = lim.max_model_len
        if len(ids) >= max_len:
            # the first sentence is vLLM's: clients recognise a context overflow by it (LiteLLM's ContextWindowExceededError)
            raise ValueError(
                f"This model's maximum context length is {max_len} tokens. However, your request has {len(ids)} input tokens "
                f"(prompt has {len(ids)} tokens but max_model_len is {max_len}: a prompt may have at most {max_len - 1} tokens)"
            )
        for name, token_ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            out_of_vocab = sorted(t for t in token_ids if t >= lim.vocab_size)
            if out_of_vocab:  # vLLM's sentence
                raise ValueError(f"token_id(s) {out_of_vocab[:5]} in {name} contain out-of-vocab token ids. "
                                 f"Vocabulary size: {lim.vocab_size}")
        resume = list(resume_token_ids or [])
        if any(not isinstance(t, int) or not 0 <= t < lim.vocab_size for t in resume):
            raise ValueError(f"resume_token_ids must be integers in [0, {lim.vocab_size})")
        if len(ids) + len(resume) >= max_len:
            raise ValueError(f"prompt + resumed tokens ({len(ids) + len(resume)}) must stay below max_model_len {max_len}")
        need = -(-(len(ids) + len(resume) + 1) // lim.block_size)
        if need > lim.num_blocks:
            raise ValueError(
                f"prompt needs {need} KV blocks but the whole pool has {lim.num_blocks}; "
                "shorten it or give the engine more KV memory"
            )
        if params.n > lim.max_num_seqs:
            raise ValueError(f"n ({params.n}) must be <= max_num_seqs ({lim.max_num_seqs})")
        if params.n > 1 and resume:
            raise ValueError("resume_token_ids is only supported with n == 1")
        return ids, resume, params

    def chat_token_ids(self, messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
                       continue_final_message: bool = False, chat_template: str | None = None,
                       chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt of a conversation: transformers' ``apply_chat_template`` with vLLM's options (the model's
        template, or ``chat_template``; ``chat_template_kwargs`` as extra template variables). ``ValueError`` for
        anything the request got wrong, a template that fails to render included (that request fails alone)."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.model} has no tokenizer, so no chat template")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"each message needs string 'role' and 'content', got {m!r}")
        if add_generation_prompt and continue_final_message:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError("chat_template must be a string (a Jinja template)")
        extra = dict(chat_template_kwargs or {})
        reserved = sorted(set(extra) & set(RESERVED_TEMPLATE_ARGS))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved[0]!r}: it is an argument of the template call itself")
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"the tokenizer of {self.model} has no chat template")
        kw: dict[str, Any] = {}
        if tools:
            has_tools = ("tools" in chat_template) if chat_template is not None else template_has_tools(self.tokenizer)
            if not has_tools:
                which = "the request's chat template" if chat_template is not None else f"the chat template of {self.model}"
                raise ValueError(f"{which} has no tool format (it never reads `tools`)")
            kw["tools"] = tools
        if chat_template is not None:
            kw["chat_template"] = chat_template
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     continue_final_message=continue_final_message, tokenize=True,
                                                     **kw, **extra)
        except Exception as exc:  # raise_exception(), a syntax error, an undefined name, a sandbox refusal...
            raise ValueError(f"the chat template failed to render: {type(exc).__name__}: {exc}") from exc
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)


class ChatRequests:
    """``apply_chat_template`` and ``add_chat_request`` for an engine front end that has ``inputs``
    (an ``InputProcessor``) and ``add_request``: ``LLMEngine`` and ``EngineProcess`` both."""

    inputs: InputProcessor

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, *,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return self.inputs.chat_token_ids(messages, tools, add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message, chat_template=chat_template,
                                          chat_template_kwargs=chat_template_kwargs)

    def add_chat_request(self, request_id: str, messages: list[dict], params: SamplingParams | None = None,
                         tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
                         continue_final_message: bool = False, chat_template: str | None = None,
                         chat_template_kwargs: dict[str, Any] | None = None, **kwargs) -> None:
        ids = self.apply_chat_template(messages, tools, add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, chat_template=chat_template,
                                       chat_template_kwargs=chat_template_kwargs)
        self.add_request(request_id, prompt_token_ids=ids, params=params, **kwargs)


def template_has_tools(tokenizer) -> bool | None:
    """Whether the tokenizer's chat template renders ``tools`` (None: no template to tell)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one, or a "tool_use" one
        return "tool_use" in template or "tools" in str(template.get("default", ""))
    return "tools" in template if isinstance(template, str) else None

"""What the worker needs of an engine: ``LLMEngine`` in-process, ``EngineProcess`` (the engine in a
child process) and ``worker.fake_engine.FakeEngine`` (tests, ``pagestream demo``) all satisfy it.

The loop only admits, steps and aborts (ARCHITECTURE.md, "Ownership": ``LLMEngine`` owns the step);
``tests/test_worker.py`` checks each engine against this protocol.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pagestream.engine.config import EngineConfig
    from pagestream.engine.outputs import RequestOutput
    from pagestream.engine.sampling_params import SamplingParams


@runtime_checkable
class Engine(Protocol):
    config: EngineConfig  # the worker reads max_num_seqs from it
    tokenizer: Any  # names the tokens of logprobs (None: ids only)

    def add_request(self, request_id: str, prompt: str | None = None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, resume_token_ids: list[int] | None = None,
                    priority: int = 0, truncate_prompt_tokens: int | None = None,
                    truncation_side: str | None = None) -> None:
        """Queue a request; ``ValueError`` at once when it cannot run (the job fails alone). The worker passes
        ``truncate_prompt_tokens`` / ``truncation_side`` only to a job that sets them (vLLM's: the prompt's last k
        tokens after tokenizing, "right": its first k; -1: ``max_model_len``)."""

    def add_chat_request(self, request_id: str, messages: list[dict], params: SamplingParams | None = None,
                         **kwargs: Any) -> None:
        """A conversation through the chat template; ``kwargs`` may hold ``tools`` and vLLM's template options
        (``add_generation_prompt``, ``continue_final_message``, ``chat_template``, ``chat_template_kwargs``) besides
        ``add_request``'s; ``ValueError`` for a conversation or template that cannot render."""

    def abort_request(self, request_id: str) -> Any: ...

    def step(self) -> list[RequestOutput]:
        """One step: the token deltas of every running request (finished ones say so)."""

    def has_unfinished_requests(self) -> bool: ...

    def num_admittable(self) -> int:
        """How many more requests the engine would admit now (the worker reads no more than that)."""

    def stats(self) -> Any: ...

    def take_iteration_tokens(self) -> list[int]:
        """The tokens each engine step computed since the last call (prompt + decode), oldest first: the worker
        observes them as ``vllm:iteration_tokens_total``."""

"""``/v1/completions``: prompts (text or token ids, one job each) in, ``text_completion`` out."""
from __future__ import annotations

from typing import Any

from pagestream.producer.gateway.protocol import CompletionRequest, completion_chunk, total_usage
from pagestream.producer.gateway.serving import OpenAIServing
from pagestream.producer.protocol.openai import completion_logprobs, finish_reason, prompt_logprobs_body
from pagestream.producer.protocol.schema import JobResult, SampleResult, TokenLogprob


def echo_text(req: CompletionRequest, prompt: str | list[int], prompt_lps: list[TokenLogprob]) -> str:
    """The text ``echo`` leads a choice with, as vLLM's ``serving_completion`` picks it: none with
    ``return_token_ids``; a text prompt as sent (truncated or not); a token-id prompt's tokens as the worker named
    them in the prompt's logprobs."""
    if req.return_token_ids:
        return ""
    return "".join(t.token for t in prompt_lps) if req.echoes_tokens(prompt) else prompt


def _samples(result: JobResult) -> list[SampleResult]:
    return result.outputs or [SampleResult(index=0, text=result.text, token_ids=result.token_ids,
                                           finish_reason=result.finish_reason)]


class OpenAIServingCompletion(OpenAIServing):
    request_model = CompletionRequest
    id_prefix = "cmpl"
    chunk_object = "text_completion"

    def body(self, req: CompletionRequest, rid: str, created: int, results: list[JobResult]) -> dict[str, Any]:
        """OpenAI's choice order: prompt p's sample s is choice ``p * n + s``.

        With ``echo`` the prompt leads each choice's text and, with ``logprobs``, its tokens lead the logprobs
        (the first with None, as vLLM's); ``echo`` with ``max_tokens=0`` answers the prompt alone."""
        prompts = req.prompts()
        as_ids = req.return_tokens_as_token_ids
        # vLLM reports the prompt logprobs it computed: asked for, or what echo with logprobs needed
        show_prompt_lps = req.prompt_logprobs is not None or (req.echo and req.logprobs is not None)
        choices = []
        for p, result in enumerate(results):
            prompt_lps = result.prompt_logprobs or []
            echo = echo_text(req, prompts[p], prompt_lps) if req.echo else ""
            for s in _samples(result):
                text, lps, ids = (echo, [], []) if req.echo_only else (echo + s.text, s.logprobs or [], s.token_ids)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = completion_logprobs([*prompt_lps, *lps] if req.echo else lps, 0, as_ids)
                choice: dict[str, Any] = {
                    "index": p * req.n + s.index, "text": text, "finish_reason": finish_reason(s.finish_reason),
                    "logprobs": logprobs,
                }
                if show_prompt_lps:
                    choice["prompt_logprobs"] = prompt_logprobs_body(prompt_lps, as_ids) if result.prompt_logprobs else None
                if req.return_token_ids:  # vLLM's extension: the ids beside the text
                    choice["prompt_token_ids"] = result.prompt_token_ids
                    choice["token_ids"] = ids
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        return {"id": rid, "object": "text_completion", "created": created, "model": req.model, "choices": choices,
                "usage": total_usage(results, self.settings.enable_prompt_tokens_details)}

    def lead(self, req: CompletionRequest, p: int, prompt_lps: list[TokenLogprob] | None) -> tuple[str, list[TokenLogprob]]:
        """A streamed ``echo``: the prompt (and, with ``logprobs``, its tokens' logprobs, the first None) leads each
        choice's first chunk, before its first tokens, as vLLM streams it; offsets then count the prompt too."""
        if not req.echo:
            return "", []
        lps = prompt_lps or []
        return echo_text(req, req.prompts()[p], lps), (lps if req.logprobs is not None else [])

    def hides_output(self, req: CompletionRequest) -> bool:
        return req.echo_only

    def put_prompt_token_ids(self, chunk: dict[str, Any], ids: list[int]) -> None:
        chunk["choices"][0]["prompt_token_ids"] = ids  # vLLM's: on each choice's first chunk

    def chunk(self, req, rid, created, index, text, reason=None, logprobs=None) -> dict[str, Any]:
        return completion_chunk(rid, req.model, created, index, text, reason, logprobs)

    def stream_logprobs(self, req: CompletionRequest, lps: list[TokenLogprob], text_offset: int) -> dict:
        return completion_logprobs(lps, text_offset, req.return_tokens_as_token_ids)

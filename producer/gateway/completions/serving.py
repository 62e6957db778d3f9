"""``/v1/completions``: prompts (text or token ids, one job each) in, ``text_completion`` out."""
from __future__ import annotations

from typing import Any

from pagestream.producer.gateway.protocol import CompletionRequest, completion_chunk, total_usage
from pagestream.producer.gateway.serving import OpenAIServing
from pagestream.producer.protocol.openai import completion_logprobs, finish_reason
from pagestream.producer.protocol.schema import JobResult, SampleResult, TokenLogprob


def _samples(result: JobResult) -> list[SampleResult]:
    return result.outputs or [SampleResult(index=0, text=result.text, token_ids=result.token_ids,
                                           finish_reason=result.finish_reason)]


class OpenAIServingCompletion(OpenAIServing):
    request_model = CompletionRequest
    id_prefix = "cmpl"
    chunk_object = "text_completion"

    def body(self, req: CompletionRequest, rid: str, created: int, results: list[JobResult]) -> dict[str, Any]:
        """OpenAI's choice order: prompt p's sample s is choice ``p * n + s``."""
        prompts = req.prompts()
        choices = []
        for p, result in enumerate(results):
            echo = prompts[p] if req.echo else ""
            for s in _samples(result):
                choice: dict[str, Any] = {
                    "index": p * req.n + s.index, "text": echo + s.text, "finish_reason": finish_reason(s.finish_reason),
                    "logprobs": None if s.logprobs is None else completion_logprobs(s.logprobs, 0, req.return_tokens_as_token_ids),
                }
                if req.return_token_ids:  # vLLM's extension: the ids beside the text
                    choice["prompt_token_ids"] = result.prompt_token_ids
                    choice["token_ids"] = s.token_ids
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        return {"id": rid, "object": "text_completion", "created": created, "model": req.model, "choices": choices,
                "usage": total_usage(results)}

    def opening_chunks(self, req: CompletionRequest, rid: str, created: int) -> list[dict[str, Any]]:
        if not req.echo:
            return []
        return [completion_chunk(rid, req.model, created, p * req.n + s, prompt)
                for p, prompt in enumerate(req.prompts()) for s in range(req.n)]

    def chunk(self, req, rid, created, index, text, reason=None, logprobs=None) -> dict[str, Any]:
        return completion_chunk(rid, req.model, created, index, text, reason, logprobs)

    def stream_logprobs(self, req: CompletionRequest, lps: list[TokenLogprob], text_offset: int) -> dict:
        return completion_logprobs(lps, text_offset, req.return_tokens_as_token_ids)

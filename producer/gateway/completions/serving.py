"""``/v1/completions``: a prompt (text or token ids) in, ``text_completion`` out."""
from __future__ import annotations

from typing import Any

from pagestream.producer.gateway.protocol import CompletionRequest, completion_chunk
from pagestream.producer.gateway.serving import OpenAIServing
from pagestream.producer.protocol.openai import completion_logprobs, text_completion_body
from pagestream.producer.protocol.schema import JobResult, TokenLogprob


class OpenAIServingCompletion(OpenAIServing):
    request_model = CompletionRequest
    id_prefix = "cmpl"
    chunk_object = "text_completion"

    def body(self, rid: str, model: str, created: int, result: JobResult) -> dict[str, Any]:
        return text_completion_body(rid, model, created, result)

    def chunk(self, rid, model, created, index, text, reason=None, logprobs=None) -> dict[str, Any]:
        return completion_chunk(rid, model, created, index, text, reason, logprobs)

    def stream_logprobs(self, lps: list[TokenLogprob], text_offset: int) -> dict:
        return completion_logprobs(lps, text_offset)

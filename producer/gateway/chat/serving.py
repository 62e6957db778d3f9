"""``/v1/chat/completions``: messages in (through the model's chat template at the worker), ``chat.completion`` out."""
from __future__ import annotations

from typing import Any

from pagestream.producer.gateway.protocol import ChatCompletionRequest, chat_chunk
from pagestream.producer.gateway.serving import OpenAIServing
from pagestream.producer.protocol.openai import chat_completion_body, chat_logprobs
from pagestream.producer.protocol.schema import JobResult, TokenLogprob


class OpenAIServingChat(OpenAIServing):
    request_model = ChatCompletionRequest
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def body(self, rid: str, model: str, created: int, result: JobResult) -> dict[str, Any]:
        return chat_completion_body(rid, model, created, result)

    def chunk(self, rid, model, created, index, text, reason=None, logprobs=None) -> dict[str, Any]:
        return chat_chunk(rid, model, created, index, text, reason, logprobs)

    def opening_chunks(self, rid: str, model: str, created: int, n: int) -> list[dict[str, Any]]:
        return [chat_chunk(rid, model, created, i, "", role=True) for i in range(n)]

    def stream_logprobs(self, lps: list[TokenLogprob], text_offset: int) -> dict:
        return chat_logprobs(lps)

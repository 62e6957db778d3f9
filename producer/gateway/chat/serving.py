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

    def body(self, req: ChatCompletionRequest, rid: str, created: int, results: list[JobResult]) -> dict[str, Any]:
        (result,) = results
        body = chat_completion_body(rid, req.model, created, result)
        samples = {s.index: s for s in result.outputs}
        echo = req.echo_text()
        for choice in body["choices"]:
            choice["message"]["content"] = echo + choice["message"]["content"]
            s = samples.get(choice["index"])
            if req.return_tokens_as_token_ids and s is not None and s.logprobs is not None:
                choice["logprobs"] = chat_logprobs(s.logprobs, as_token_ids=True)
            if req.return_token_ids:
                choice["token_ids"] = s.token_ids if s is not None else result.token_ids
        if req.return_token_ids:  # vLLM puts the prompt's ids on the response, the output's on each choice
            body["prompt_token_ids"] = result.prompt_token_ids
        return body

    def chunk(self, req, rid, created, index, text, reason=None, logprobs=None) -> dict[str, Any]:
        return chat_chunk(rid, req.model, created, index, text, reason, logprobs)

    def opening_chunks(self, req: ChatCompletionRequest, rid: str, created: int) -> list[dict[str, Any]]:
        chunks = [chat_chunk(rid, req.model, created, i, "", role=True) for i in range(req.n)]
        echo = req.echo_text()
        if echo:
            chunks += [chat_chunk(rid, req.model, created, i, echo) for i in range(req.n)]
        return chunks

    def stream_logprobs(self, req: ChatCompletionRequest, lps: list[TokenLogprob], text_offset: int) -> dict:
        return chat_logprobs(lps, req.return_tokens_as_token_ids)

"""``/v1/chat/completions``: messages in (through the model's chat template at the worker), ``chat.completion`` out."""
from __future__ import annotations

import contextlib
from typing import Any

from pagestream.producer.gateway.chat.tools import ToolCallStream, answer_calls, check_tools
from pagestream.producer.gateway.protocol import ChatCompletionRequest, chat_chunk, check_trusted_template
from pagestream.producer.gateway.serving import OpenAIServing
from pagestream.producer.protocol.openai import chat_completion_body, chat_logprobs, prompt_logprobs_body
from pagestream.producer.protocol.schema import JobResult, TokenLogprob


class OpenAIServingChat(OpenAIServing):
    request_model = ChatCompletionRequest
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def body(self, req: ChatCompletionRequest, rid: str, created: int, results: list[JobResult]) -> dict[str, Any]:
        (result,) = results
        body = chat_completion_body(rid, req.model, created, result, self.settings.enable_prompt_tokens_details)
        samples = {s.index: s for s in result.outputs}
        echo = req.echo_text()
        for choice in body["choices"]:
            choice["message"]["content"] = echo + choice["message"]["content"]
            s = samples.get(choice["index"])
            if req.return_tokens_as_token_ids and s is not None and s.logprobs is not None:
                choice["logprobs"] = chat_logprobs(s.logprobs, as_token_ids=True)
            if req.return_token_ids:
                choice["token_ids"] = s.token_ids if s is not None else result.token_ids
        if result.prompt_logprobs is not None and req.return_tokens_as_token_ids:
            body["prompt_logprobs"] = prompt_logprobs_body(result.prompt_logprobs, as_token_ids=True)
        if req.return_token_ids:  # vLLM puts the prompt's ids on the response, the output's on each choice
            body["prompt_token_ids"] = result.prompt_token_ids
        use = req.tool_use()
        if use.active:
            answer_calls(body, {i: s.text for i, s in samples.items()} or {0: result.text}, use, self.settings)
        return body

    def parse(self, data: dict[str, Any]) -> ChatCompletionRequest:
        req = super().parse(data)
        # before anything renders it (the context check may ask a worker's tokenizer)
        check_trusted_template(req.chat_template, req.chat_template_kwargs, self.settings.trust_request_chat_template)
        return req

    async def check_request(self, req: ChatCompletionRequest) -> None:
        if req.tools:
            check_tools(req, self.settings, (await self.state.models.served()).get(req.model, {}))

    async def chunker(self, req: ChatCompletionRequest, rid: str, created: int, job_ids: list[str],
                      resume_from: int | None):
        use = req.tool_use()
        if not use.active:
            return await super().chunker(req, rid, created, job_ids, resume_from)
        stream = ToolCallStream(req, rid, created, use, self.settings)
        if resume_from:  # a resumed stream (one job, n=1): its parser catches up on the text its client had
            stream(0, await self._text_before(job_ids[0], resume_from))
        return stream

    async def _text_before(self, job_id: str, index: int) -> str:
        parts = []
        events = aiter(self.producer.follow(job_id, 0, timeout=self.settings.request_timeout_s))
        async with contextlib.aclosing(events):  # its reads end with the loop
            async for ev in events:
                if ev.index >= index:
                    break
                parts.append(ev.text)
        return "".join(parts)

    prompt_ids_per_choice = False

    def put_prompt_token_ids(self, chunk: dict[str, Any], ids: list[int]) -> None:
        chunk["prompt_token_ids"] = ids  # vLLM's: on the chunk object, once in the stream

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

"""``/v1/responses``: a Responses request run as a chat job, answered as a ``response`` object or as OpenAI's
typed stream events, and stored in Redis (its owner, the object, the conversation) for ``retrieve`` and
``previous_response_id``.

The stream is chat's (``OpenAIServing.chunk_stream``: the job's token events, exactly once across a worker's
crash and its job's resume), its chunks turned into Responses events by ``ResponseEvents``.
"""
from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from pagestream.producer.gateway.asgi import EventStream
from pagestream.producer.gateway.chat.serving import OpenAIServingChat
from pagestream.producer.gateway.errors import GatewayError
from pagestream.producer.gateway.limits import StreamSlot
from pagestream.producer.gateway.protocol import MAX_LISTED_ERRORS, first_error_loc
from pagestream.producer.gateway.responses.protocol import (ResponsesChatRequest, ResponsesRequest, function_call_item,
                                                            message_item, response_object, text_part)
from pagestream.producer.gateway.serving import sse
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.errors import RequestError
from pagestream.producer.protocol.schema import JobResult, format_validation_error
from pagestream.producer.protocol.tenants import ANONYMOUS, Tenant


def _tenant_name(request: Request) -> str:
    tenant = getattr(request.state, "tenant", None)
    return tenant.name if tenant is not None else ANONYMOUS


class ResponseStore:
    """Stored responses: one JSON value a response (``keys.response_record``) with a TTL; a read is scoped to
    the asking tenant (another's response is not found)."""

    def __init__(self, redis, ttl_s: int) -> None:
        self.redis, self.ttl_s = redis, ttl_s

    async def put(self, owner: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        record = {"tenant": owner, "response": response, "conversation": conversation}
        await self.redis.set(keys.response_record(response["id"]), json.dumps(record), ex=self.ttl_s)

    async def get(self, response_id: str, tenant: Tenant | None) -> dict[str, Any] | None:
        raw = await self.redis.get(keys.response_record(response_id))
        record = json.loads(raw) if raw else None
        if record is None or (tenant is not None and not tenant.owns(record["tenant"])):
            return None
        return record

    async def delete(self, response_id: str) -> None:
        await self.redis.delete(keys.response_record(response_id))


def _assistant_turn(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a next turn's prompt continues with."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


class OpenAIServingResponses(OpenAIServingChat):
    id_prefix = "resp"
    chunk_object = "response"

    def __init__(self, state) -> None:
        super().__init__(state)
        self.store = ResponseStore(self.producer.redis, self.settings.response_ttl_s)

    def response_id(self, job_id: str) -> str:
        return f"resp_{job_id}"

    async def create(self, request: Request, data: dict[str, Any]) -> Response:
        try:
            rreq = ResponsesRequest.model_validate(data)
        except ValidationError as exc:
            raise GatewayError(400, format_validation_error(exc, max_errors=MAX_LISTED_ERRORS), param=first_error_loc(exc)) from None
        history: list[dict[str, Any]] = []
        if rreq.previous_response_id is not None:
            previous = await self.store.get(rreq.previous_response_id, getattr(request.state, "tenant", None))
            if previous is None:
                raise GatewayError(404, f"Previous response with id '{rreq.previous_response_id}' not found.",
                                   param="previous_response_id", code="previous_response_not_found")
            history = previous["conversation"]
        try:
            req, _ = rreq.to_chat(history)
        except ValidationError as exc:  # chat's model refused it: its locations named as the Responses request's
            param = first_error_loc(exc)
            if param is not None and param.startswith("tools."):
                param = param.replace(".function.", ".", 1)
            raise GatewayError(400, format_validation_error(exc, max_errors=MAX_LISTED_ERRORS), param=param) from None
        except RequestError as exc:
            raise GatewayError(400, exc.message, param=exc.param, code=exc.code) from None
        return await self.serve(request, data, req)

    async def retrieve(self, response_id: str, tenant: Tenant | None) -> dict[str, Any]:
        record = await self.store.get(response_id, tenant)
        if record is None:
            raise GatewayError(404, f"Response with id '{response_id}' not found.", code="not_found")
        return record["response"]

    async def delete(self, response_id: str, tenant: Tenant | None) -> dict[str, Any]:
        await self.retrieve(response_id, tenant)
        await self.store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(self, response_id: str, tenant: Tenant | None) -> dict[str, Any]:
        await self.retrieve(response_id, tenant)
        raise GatewayError(400, "Only background responses can be cancelled (this server runs none).",
                           code="not_background")

    def output_items(self, rid: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        (choice,) = body["choices"]
        message = choice["message"]
        output = []
        if message.get("content"):
            output.append(message_item(f"msg_{rid.removeprefix('resp_')}", message["content"]))
        for k, call in enumerate(message.get("tool_calls") or []):
            output.append(function_call_item(f"fc_{rid.removeprefix('resp_')}_{k}", call["id"],
                                             call["function"]["name"], call["function"]["arguments"]))
        return output

    async def answer(self, req: ResponsesChatRequest, rid: str, created: int, results: list[JobResult]) -> dict[str, Any]:
        body = self.body(req, rid, created, results)
        output = self.output_items(rid, body)
        response = response_object(req.responses, rid, created, output, "completed", body["usage"],
                                   body["choices"][0]["finish_reason"])
        if req.responses.store:
            await self.store.put(req._owner, response, req.conversation + _assistant_turn(output))
        return response

    async def serve(self, request: Request, data: dict[str, Any], req: ResponsesChatRequest) -> Response:
        req._owner = _tenant_name(request)
        return await super().serve(request, data, req)

    async def _abandoned(self, job_ids: list[str], owner: str, slot: StreamSlot | None, detached: bool) -> None:
        if not detached:
            for job_id in job_ids:
                await self.producer.cancel(job_id)
            await self.state.admission.release(owner, job_ids)
        if slot is not None:
            await self.state.admission.drop_stream(slot)

    def event_stream(self, *args: Any, **kwargs: Any) -> EventStream:
        """Chat's stream as Responses events (``events``)."""
        return EventStream(self.events(*args, **kwargs), headers={"Cache-Control": "no-cache"})

    async def events(self, req: ResponsesChatRequest, rid: str, created: int, job_ids: list[str], arrived: float,
                     max_tokens: int | None, resume_from: int | None = None, owner: str = ANONYMOUS,
                     slot: StreamSlot | None = None, detached: bool = False) -> AsyncIterator[bytes]:
        out = ResponseEvents(req, rid, created)
        response = response_object(req.responses, rid, created, [], "in_progress")
        chunks = self.chunk_stream(req, rid, created, job_ids, arrived, max_tokens, resume_from, owner, slot, detached)
        try:
            if req.responses.store:
                await self.store.put(owner, response, req.conversation)
            yield out.event("response.created", response=response)
            yield out.event("response.in_progress", response=response)
        except BaseException:  # the client left before chat's stream began (whose finally would have ended the job)
            await chunks.aclose()  # never started: nothing runs
            self.state.spawn(self._abandoned(job_ids, owner, slot, detached))
            raise
        async with contextlib.aclosing(chunks):  # closed with this stream: its finally cancels or releases the job
            async for obj, _ in chunks:
                if obj == "[DONE]":
                    break
                if "error" in obj:
                    failed = response_object(req.responses, rid, created, out.close(), "failed", error={
                        "code": "server_error", "message": obj["error"]["message"]})
                    if req.responses.store:
                        await self.store.put(owner, failed, req.conversation)
                    yield out.event("response.failed", response=failed)
                    return
                for frame in out.chunk(obj):
                    yield frame
        for frame in out.finish():
            yield frame
        output = out.items()
        done = response_object(req.responses, rid, created, output, "completed", out.usage, out.finish_reason)
        if req.responses.store:
            await self.store.put(owner, done, req.conversation + _assistant_turn(output))
        # as vLLM ends every stream that ran to its end: ``response.completed`` with the response's own status
        # (``incomplete`` when max_output_tokens cut it off), which the SDK's stream helpers wait for
        yield out.event("response.completed", response=done)


class ResponseEvents:
    """One stream's chat chunks as Responses events, numbered from 0: a message item with one ``output_text``
    part for content, a ``function_call`` item per tool call, each opened when its first delta comes and
    closed at the end."""

    def __init__(self, req: ResponsesChatRequest, rid: str, created: int) -> None:
        self.rid, self.seq = rid, 0
        self.base = rid.removeprefix("resp_")
        self.open: list[dict[str, Any]] = []  # output items in order, as they are being built
        self.message: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # chat's tool-call index -> its item
        self.usage: dict[str, int] | None = None
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        frame = sse({"type": kind, "sequence_number": self.seq, **fields}, event=kind)
        self.seq += 1
        return frame

    def chunk(self, obj: dict[str, Any]) -> list[bytes]:
        frames: list[bytes] = []
        if obj.get("usage"):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                frames += self._text(delta["content"])
            for tc in delta.get("tool_calls") or []:
                frames += self._call(tc)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return frames

    def _text(self, text: str) -> list[bytes]:
        frames = []
        if self.message is None:
            self.message = {"item": message_item(f"msg_{self.base}", "", "in_progress"), "text": "",
                            "index": len(self.open)}
            self.open.append(self.message)
            frames.append(self.event("response.output_item.added", output_index=self.message["index"],
                                     item=self.message["item"]))
            frames.append(self.event("response.content_part.added", item_id=self.message["item"]["id"],
                                     output_index=self.message["index"], content_index=0, part=text_part("")))
        self.message["text"] += text
        frames.append(self.event("response.output_text.delta", item_id=self.message["item"]["id"],
                                 output_index=self.message["index"], content_index=0, delta=text, logprobs=[]))
        return frames

    def _call(self, tc: dict[str, Any]) -> list[bytes]:
        frames = []
        entry = self.calls.get(tc["index"])
        fn = tc.get("function") or {}
        if entry is None:
            item = function_call_item(f"fc_{self.base}_{tc['index']}", tc.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                                      fn.get("name") or "", "", "in_progress")
            entry = {"item": item, "arguments": "", "index": len(self.open)}
            self.calls[tc["index"]] = entry
            self.open.append(entry)
            frames.append(self.event("response.output_item.added", output_index=entry["index"], item=item))
        if fn.get("arguments"):
            entry["arguments"] += fn["arguments"]
            frames.append(self.event("response.function_call_arguments.delta", item_id=entry["item"]["id"],
                                     output_index=entry["index"], delta=fn["arguments"]))
        return frames

    def _done_item(self, entry: dict[str, Any]) -> dict[str, Any]:
        item = entry["item"]
        if item["type"] == "message":
            return message_item(item["id"], entry["text"])
        return {**item, "arguments": entry["arguments"], "status": "completed"}

    def finish(self) -> list[bytes]:
        frames = []
        for entry in self.open:
            item = self._done_item(entry)
            if item["type"] == "message":
                frames.append(self.event("response.output_text.done", item_id=item["id"], output_index=entry["index"],
                                         content_index=0, text=entry["text"], logprobs=[]))
                frames.append(self.event("response.content_part.done", item_id=item["id"], output_index=entry["index"],
                                         content_index=0, part=text_part(entry["text"])))
            else:
                frames.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                         output_index=entry["index"], name=item["name"], arguments=item["arguments"]))
            frames.append(self.event("response.output_item.done", output_index=entry["index"], item=item))
        return frames

    def items(self) -> list[dict[str, Any]]:
        return [self._done_item(e) for e in self.open]

    def close(self) -> list[dict[str, Any]]:
        """The items so far (a failed stream's partial output)."""
        return self.items()

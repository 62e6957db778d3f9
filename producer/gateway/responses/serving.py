"""``/v1/responses``: a Responses request run as a chat job, answered as a ``response`` object or as OpenAI's
typed stream events, and stored in Redis (its owner, the object, the conversation) for ``retrieve`` and
``previous_response_id``.

The stream is chat's (``OpenAIServing.chunk_stream``: the job's token events, exactly once across a worker's
crash and its job's resume), its chunks turned into Responses events by ``ResponseEvents``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
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
from pagestream.producer.protocol.limits import job_limits
from pagestream.producer.protocol.schema import JobRequest, JobResult, JobStatus, format_validation_error
from pagestream.producer.protocol.tenants import ANONYMOUS, Tenant


def _tenant_name(request: Request) -> str:
    tenant = getattr(request.state, "tenant", None)
    return tenant.name if tenant is not None else ANONYMOUS


class ResponseStore:
    """Stored responses: one JSON value a response (``keys.response_record``) with a TTL; a read is scoped to
    the asking tenant (another's response is not found)."""

    def __init__(self, redis, ttl_s: int) -> None:
        self.redis, self.ttl_s = redis, ttl_s

    async def put(self, owner: str, response: dict[str, Any], conversation: list[dict[str, Any]],
                  background: dict[str, Any] | None = None, keep_ttl: bool = False) -> None:
        """``background``: a background response's request and the conversation it continued (what its answer is
        rebuilt from once its job ends); ``keep_ttl``: an update that leaves the record's expiry where it was."""
        record = {"tenant": owner, "response": response, "conversation": conversation}
        if background is not None:
            record["background"] = background
        key = keys.response_record(response["id"])
        if keep_ttl:
            await self.redis.set(key, json.dumps(record), keepttl=True)
        else:
            await self.redis.set(key, json.dumps(record), ex=self.ttl_s)

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


#: a background response's statuses while its job is not final
_RUNNING = ("queued", "in_progress")


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
            history = (await self.settle(previous))["conversation"]
        try:
            req, _ = rreq.to_chat(history)
        except ValidationError as exc:  # chat's model refused it: its locations named as the Responses request's
            param = first_error_loc(exc)
            if param is not None and param.startswith("tools."):
                param = param.replace(".function.", ".", 1)
            raise GatewayError(400, format_validation_error(exc, max_errors=MAX_LISTED_ERRORS), param=param) from None
        except RequestError as exc:
            raise GatewayError(400, exc.message, param=exc.param, code=exc.code) from None
        req._background = {"request": data, "history": history} if rreq.background else None
        return await self.serve(request, data, req)

    async def load(self, response_id: str, tenant: Tenant | None) -> dict[str, Any]:
        """The stored record (404 if none is the tenant's), a background one brought up to its job's status."""
        record = await self.store.get(response_id, tenant)
        if record is None:
            raise GatewayError(404, f"Response with id '{response_id}' not found.", code="not_found")
        return await self.settle(record)

    def _rebuild(self, background: dict[str, Any]) -> ResponsesChatRequest:
        req, _ = ResponsesRequest.model_validate(background["request"]).to_chat(background["history"])
        req._background = background
        return req

    async def settle(self, record: dict[str, Any]) -> dict[str, Any]:
        """A background response as its job stands: ``queued`` / ``in_progress`` while it waits or runs; once the
        job is final, its answer (``completed`` / ``incomplete``), ``failed`` or ``cancelled``, stored (any
        gateway may do this, the first read after the job ends does)."""
        response, background = record["response"], record.get("background")
        if background is None or response["status"] not in _RUNNING:
            return record
        rid = response["id"]
        job_id = rid.removeprefix("resp_")
        status = await self.producer.status(job_id)
        if status in (JobStatus.QUEUED, JobStatus.RUNNING):
            response["status"] = "queued" if status == JobStatus.QUEUED else "in_progress"
            return record
        req = self._rebuild(background)
        conversation = record["conversation"]
        if status is None:
            response = {**response, "status": "failed",
                        "error": {"code": "server_error", "message": "the response's job is gone (expired or lost)"}}
        else:
            result = await self.producer.result(job_id, timeout=30)
            if result.status == JobStatus.COMPLETED:
                body = self.body(req, rid, response["created_at"], [result])
                output = self.output_items(rid, body)
                response = response_object(req.responses, rid, response["created_at"], output, "completed",
                                           body["usage"], body["choices"][0]["finish_reason"])
                conversation = conversation + _assistant_turn(output)
            elif result.status == JobStatus.CANCELLED:
                response = {**response, "status": "cancelled"}
            else:
                response = {**response, "status": "failed",
                            "error": {"code": "server_error", "message": result.error or f"the job {result.status.value}"}}
        stored = await self.keep(req, record["tenant"], response, conversation)
        await self.state.admission.release(record["tenant"], [job_id])
        return {**record, "response": stored, "conversation": conversation}

    async def keep(self, req: ResponsesChatRequest, owner: str, response: dict[str, Any],
                   conversation: list[dict[str, Any]]) -> dict[str, Any]:
        """Store ``response`` (if the request is stored) and answer what is stored: a background response already
        final (cancelled while its stream ran) stays as it is."""
        if not req.responses.store:
            return response
        background = req._background
        if background is None:
            await self.store.put(owner, response, conversation)
            return response
        if response["status"] not in _RUNNING:
            current = await self.store.get(response["id"], None)
            if current is not None and current["response"]["status"] not in _RUNNING:
                return current["response"]
        await self.store.put(owner, response, conversation, background, keep_ttl=response["status"] not in _RUNNING)
        return response

    async def retrieve(self, response_id: str, tenant: Tenant | None) -> dict[str, Any]:
        return (await self.load(response_id, tenant))["response"]

    async def delete(self, response_id: str, tenant: Tenant | None) -> dict[str, Any]:
        if await self.store.get(response_id, tenant) is None:
            raise GatewayError(404, f"Response with id '{response_id}' not found.", code="not_found")
        await self.store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(self, response_id: str, tenant: Tenant | None) -> dict[str, Any]:
        """A background response's job cancelled (a queued one never runs; a running one stops at the worker's
        next step) and the response answered ``cancelled``; one already final is answered as it is (OpenAI:
        cancelling is idempotent); a response not created in the background is a 400."""
        record = await self.load(response_id, tenant)
        response = record["response"]
        if record.get("background") is None:
            raise GatewayError(400, "Cannot cancel a synchronous response.", param="response_id")
        if response["status"] not in _RUNNING:
            return response
        status = await self.producer.cancel(response_id.removeprefix("resp_"))
        if status is not None and status.is_final and status != JobStatus.CANCELLED:
            return (await self.settle(record))["response"]  # it ended before the cancel reached it
        cancelled = {**response, "status": "cancelled"}
        await self.store.put(record["tenant"], cancelled, record["conversation"], record["background"], keep_ttl=True)
        return cancelled

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
        return await self.keep(req, req._owner, response, req.conversation + _assistant_turn(output))

    def detaches(self, request: Request, req: ResponsesChatRequest) -> bool:
        # a background response runs to its end whoever is connected (a worker crash resumes it as any job)
        return super().detaches(request, req) or req.responses.background

    def prepare_jobs(self, req: ResponsesChatRequest, jobs: list[JobRequest]) -> None:
        if req.responses.background:  # its answer is rebuilt from the job's result while the response is kept
            for job in jobs:
                job.result_ttl_s = min(self.settings.response_ttl_s, job_limits().max_result_ttl_s)

    async def serve(self, request: Request, data: dict[str, Any], req: ResponsesChatRequest) -> Response:
        req._owner = _tenant_name(request)
        if not req.responses.background or req.stream:
            return await super().serve(request, data, req)
        # background, not streamed: answered ``queued`` at once; GET /v1/responses/{id} follows its job
        q = await self.queue(request, req)
        rid = self.response_id(q.job_ids[0])
        response = response_object(req.responses, rid, q.created, [], "queued")
        try:
            await self.keep(req, req._owner, response, req.conversation)
        except BaseException:  # not stored: nobody could read or cancel it, so it does not run
            await asyncio.shield(self._cancel_all(q.job_ids))
            raise
        return JSONResponse(response)

    async def replay(self, request: Request, response_id: str, tenant: Tenant | None,
                     starting_after: int | None) -> Response:
        """``GET /v1/responses/{id}?stream=true``: a background response's events from the start, or after
        ``starting_after`` (a dropped stream resumed): the job's stored token events turned into the same
        numbered events again, then the live ones while it runs."""
        record = await self.load(response_id, tenant)
        background = record.get("background")
        if background is None:
            raise GatewayError(400, "This response cannot be streamed because it was not created with background=true.",
                               param="stream")
        req = self._rebuild(background)
        req._owner = record["tenant"]
        slot = await self.state.admission.admit(tenant.name if tenant is not None else record["tenant"], [], None,
                                                stream=True)
        return EventStream(self.events(req, response_id, record["response"]["created_at"],
                                       [response_id.removeprefix("resp_")], time.time(), None, owner=record["tenant"],
                                       slot=slot, detached=True,
                                       starting_after=-1 if starting_after is None else starting_after),
                           headers={"Cache-Control": "no-cache"})

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
                     slot: StreamSlot | None = None, detached: bool = False,
                     starting_after: int | None = None) -> AsyncIterator[bytes]:
        """``starting_after`` (a replay of a background response): its events numbered as the first time, those
        up to that number left out, nothing stored (the stored record is settled from the job)."""
        replay = starting_after is not None
        out = ResponseEvents(req, rid, created, skip_through=-1 if starting_after is None else starting_after)
        response = response_object(req.responses, rid, created, [], "in_progress")
        chunks = self.chunk_stream(req, rid, created, job_ids, arrived, max_tokens, resume_from, owner, slot, detached)
        try:
            if not replay:
                response = await self.keep(req, owner, response, req.conversation)
            for frame in (out.event("response.created", response=response),
                          out.event("response.in_progress", response=response)):
                if frame:
                    yield frame
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
                    if req.responses.background and obj["error"].get("code") == "cancelled":
                        failed = {**failed, "status": "cancelled", "error": None}
                    if not replay:
                        failed = await self.keep(req, owner, failed, req.conversation)
                    # no event of its own for a cancelled response: response.failed carries its status
                    frame = out.event("response.failed", response=failed)
                    if frame:
                        yield frame
                    return
                for frame in out.chunk(obj):
                    if frame:
                        yield frame
        for frame in out.finish():
            if frame:
                yield frame
        output = out.items()
        done = response_object(req.responses, rid, created, output, "completed", out.usage, out.finish_reason)
        if not replay:
            done = await self.keep(req, owner, done, req.conversation + _assistant_turn(output))
        # as vLLM ends every stream that ran to its end: ``response.completed`` with the response's own status
        # (``incomplete`` when max_output_tokens cut it off), which the SDK's stream helpers wait for
        frame = out.event("response.completed", response=done)
        if frame:
            yield frame


class ResponseEvents:
    """One stream's chat chunks as Responses events, numbered from 0: a message item with one ``output_text``
    part for content, a ``function_call`` item per tool call, each opened when its first delta comes and
    closed at the end."""

    def __init__(self, req: ResponsesChatRequest, rid: str, created: int, skip_through: int = -1) -> None:
        self.rid, self.seq = rid, 0
        self.skip_through = skip_through  # events numbered up to this are counted, not sent (b"")
        self.base = rid.removeprefix("resp_")
        self.open: list[dict[str, Any]] = []  # output items in order, as they are being built
        self.message: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # chat's tool-call index -> its item
        self.usage: dict[str, int] | None = None
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        seq, self.seq = self.seq, self.seq + 1
        if seq <= self.skip_through:
            return b""
        return sse({"type": kind, "sequence_number": seq, **fields}, event=kind)

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

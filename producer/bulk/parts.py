"""The lines of a bulk's part files: what workers write beside the orchestrator, and finalize compacts.

A part line is a ``PartEntry``: the final OpenAI batch output record of one input line (a
completion body, or an error), plus the line number and ``custom_id`` compaction sorts and
dedupes on. Workers write result entries (``result_entry``) into the bulk's storage; the
orchestrator writes the entries of lines that never became jobs (``error_entry``).

A chat line with tools carries, in its job's metadata under ``TOOL_ANSWER``, how its text is read back as
calls (``producer.protocol.tools.ToolAnswer``: the resolved ``tool_choice`` and, for ``auto``, the bulk's
``tool_call_parser``), so its output body has the gateway's ``message.tool_calls``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagestream.producer.protocol.openai import chat_completion_body, text_completion_body
from pagestream.producer.protocol.schema import JobResult
from pagestream.producer.protocol.tools import ToolAnswer

#: the bulk job's metadata key holding its ``ToolAnswer`` (a chat line whose tool_choice is not ``none``)
TOOL_ANSWER = "tool_answer"


def request_id(bulk_id: str, line: int) -> str:
    """The job id of a bulk line: deterministic, so a resumed orchestrator re-queues the same id."""
    return f"{bulk_id}-L{line}"


def line_of_job_id(job_id: str) -> int:
    """Inverse of ``request_id``: the input line number a bulk job came from."""
    return int(job_id.rsplit("-L", 1)[1])


@dataclass(slots=True)
class PartEntry:
    """One line of a part file: the final output record plus what compaction sorts and dedupes on."""

    line: int
    custom_id: str | None
    ok: bool
    record: dict[str, Any] = field(default_factory=dict)

    def dumps(self) -> bytes:
        return (json.dumps({"line": self.line, "custom_id": self.custom_id, "ok": self.ok, "record": self.record},
                           ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")

    @classmethod
    def loads(cls, raw: bytes) -> "PartEntry":
        obj = json.loads(raw)
        return cls(line=obj["line"], custom_id=obj["custom_id"], ok=obj["ok"], record=obj["record"])


def error_entry(bulk_id: str, line: int, reason: str, custom_id: str | None, code: str = "invalid_request") -> PartEntry:
    """The output of an input line that never became a job (it was invalid)."""
    record = {
        "id": f"batch_req_{request_id(bulk_id, line)}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": reason, "line": line},
    }
    return PartEntry(line=line, custom_id=custom_id, ok=False, record=record)


def result_entry(
    *,
    job_id: str,
    custom_id: str,
    chat: bool,
    result: JobResult,
    line: int | None = None,
    requested_model: str | None = None,
    error: str | None = None,
    tools: ToolAnswer | None = None,
) -> PartEntry:
    """The OpenAI batch output line for one finished job: an error line when ``error`` is set,
    else a completion body as the gateway answers it (one choice per sample, the served model's name; with
    ``tools``, each choice's text read as calls as the gateway's chat completion reads it)."""
    line = line if line is not None else line_of_job_id(job_id)
    rid = f"batch_req_{job_id}"
    if error is not None:
        record = {
            "id": rid,
            "custom_id": custom_id,
            "response": None,
            "error": {"code": "generation_failed", "message": error, "line": line},
        }
        return PartEntry(line=line, custom_id=custom_id, ok=False, record=record)
    # a served name is always set by the worker; the asked name is only a fallback for old results
    model = result.model or requested_model or "unknown"
    build = chat_completion_body if chat else text_completion_body
    body = build(f"{'chatcmpl' if chat else 'cmpl'}-{job_id}", model, int(result.finished_at), result)
    if chat and tools is not None:
        tools.answer(body, {s.index: s.text for s in result.outputs} or {0: result.text})
    record = {"id": rid, "custom_id": custom_id,
              "response": {"status_code": 200, "request_id": job_id, "body": body}, "error": None}
    return PartEntry(line=line, custom_id=custom_id, ok=True, record=record)

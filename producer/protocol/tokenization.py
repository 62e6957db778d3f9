"""The tokenizer call contract between the gateway (which has no tokenizer) and the workers (which do).

The gateway LPUSHes one JSON call onto ``keys.tokenizer_calls(model)`` and waits (BLPOP, a few seconds)
on ``keys.tokenizer_reply(call_id)``; any worker serving ``model`` BRPOPs the call, answers it with its
engine's tokenizer and RPUSHes one JSON reply onto the reply key with a ``REPLY_TTL_S`` expiry, so a
reply nobody waits for any more goes away by itself. A call carries its deadline: a worker skips a call
whose caller has already given up.

Call:  ``{"id", "op", "deadline_ms", "args": {...}}``, ``op`` one of ``TokenizerOp``; ``args`` per op:
  - ``tokenize``:   ``prompt``, ``add_special_tokens``, ``return_token_strs``
  - ``tokenize_chat``: ``messages`` (flat chat messages), ``add_generation_prompt``,
    ``continue_final_message``, ``add_special_tokens``, ``return_token_strs``
  - ``detokenize``: ``tokens``
  - ``info``: nothing
Reply: ``{"ok": true, "result": {...}}`` or ``{"ok": false, "error": message}`` (the call was refused by
the tokenizer: a 400 for the client).
  - ``tokenize`` / ``tokenize_chat`` -> ``{"tokens": [...], "token_strs": [...] | None}``
  - ``detokenize`` -> ``{"prompt": str}``
  - ``info`` -> ``{"tokenizer_class": str, ...the tokenizer's JSON-able init kwargs}``
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

#: how long a reply waits for its caller before Redis drops it
REPLY_TTL_S = 10
#: how long a call list lives past its last push (no worker serving the model: the calls go away)
CALLS_TTL_S = 30


class TokenizerOp(str, Enum):
    TOKENIZE = "tokenize"
    TOKENIZE_CHAT = "tokenize_chat"
    DETOKENIZE = "detokenize"
    INFO = "info"


@dataclass(slots=True)
class TokenizerCall:
    op: TokenizerOp
    args: dict[str, Any] = field(default_factory=dict)
    deadline_ms: int = 0
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def new(cls, op: TokenizerOp, args: dict[str, Any], timeout_s: float) -> "TokenizerCall":
        return cls(op, args, int((time.time() + timeout_s) * 1000))

    def expired(self, now_s: float | None = None) -> bool:
        return (time.time() if now_s is None else now_s) * 1000 > self.deadline_ms

    def dumps(self) -> str:
        return json.dumps({"id": self.id, "op": self.op.value, "deadline_ms": self.deadline_ms, "args": self.args})

    @classmethod
    def loads(cls, raw: bytes | str) -> "TokenizerCall":
        """The call in ``raw``; ``ValueError`` for anything that is not one."""
        data = json.loads(raw)
        if not isinstance(data, dict) or not isinstance(data.get("id"), str) or not isinstance(data.get("args", {}), dict):
            raise ValueError("not a tokenizer call")
        return cls(TokenizerOp(data.get("op")), data.get("args", {}), int(data.get("deadline_ms", 0)), data["id"])


def ok_reply(result: dict[str, Any]) -> str:
    return json.dumps({"ok": True, "result": result})


def error_reply(message: str) -> str:
    return json.dumps({"ok": False, "error": message})


def parse_reply(raw: bytes | str) -> tuple[bool, Any]:
    """(True, result) or (False, error message)."""
    data = json.loads(raw)
    if data.get("ok"):
        return True, data.get("result") or {}
    return False, str(data.get("error") or "the tokenizer refused the call")

"""One publisher flush on Redis Cluster: an atomic script per hash slot, then the acks.

On a single node a flush is one MULTI/EXEC. A cluster runs a transaction only within one
hash slot, and a flush spans many (each job's ``{job_id}`` keys, the lane shards, the DLQ,
the rate counters). ``SlotBatch`` takes the same calls the publisher makes on a pipeline
(``xadd``, ``hset``, ``expire``, ``incr``, ``xack``) and runs them as:

1. per slot, one ``_APPLY_LUA`` script holding that slot's writes in order: a job's tokens,
   its result, its end entry and TTLs become visible together or not at all, as with MULTI;
   the dead-letter copy of an entry lands here too. All slots go out in one pipelined round
   trip (redis-py groups them by node).
2. then the XACKs. An ack never precedes the writes it settles: a crash between 1 and 2 leaves
   the entry pending, and whoever reclaims it finds the job final and acks it unrun
   (``worker.intake``); a dead letter whose ack was lost is copied again on its next delivery.

A command Redis refuses fails alone (``redis.pcall``), as a refused command inside MULTI does.
"""
from __future__ import annotations

import hashlib
from typing import Any

import redis
from redis.crc import key_slot

from pagestream.producer.protocol.redis_conn import queue_script

# KEYS: the keys of one slot (they route the script). ARGV: commands, each as its argument
# count followed by its arguments. Returns the error messages of refused commands.
_APPLY_LUA = """
local errors = {}
local i = 1
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  local r = redis.pcall(unpack(ARGV, i + 1, i + n))
  if type(r) == 'table' and r.err then table.insert(errors, r.err) end
  i = i + n + 1
end
return errors
"""


_APPLY_SHA = hashlib.sha1(_APPLY_LUA.encode()).hexdigest()


def _b(v: Any) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode("utf-8")
    if isinstance(v, float):
        return repr(v).encode()
    return str(v).encode()


class SlotBatch:
    """The publisher's pipeline on a cluster (see the module doc). ``execute`` returns the errors."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._slots: dict[int, tuple[list[bytes], list[bytes]]] = {}  # slot -> (keys, argv)
        self._acks: dict[tuple[str, str], list[str]] = {}  # (stream, group) -> entry ids: one XACK each

    def _add(self, key: str | bytes, *cmd: Any) -> None:
        k = _b(key)
        keys, argv = self._slots.setdefault(key_slot(k), ([], []))
        if k not in keys:
            keys.append(k)
        argv.append(str(len(cmd)).encode())
        argv.extend(_b(c) for c in cmd)

    def xadd(self, name: str, fields: dict, id: str = "*", maxlen: int | None = None, approximate: bool = True) -> None:
        cmd: list[Any] = ["XADD", name]
        if maxlen is not None:
            cmd += ["MAXLEN", "~" if approximate else "=", maxlen]
        cmd.append(id)
        for k, v in fields.items():
            cmd += [k, v]
        self._add(name, *cmd)

    def hset(self, name: str, key: Any = None, value: Any = None, mapping: dict | None = None) -> None:
        pairs = ([key, value] if key is not None else []) + [x for kv in (mapping or {}).items() for x in kv]
        self._add(name, "HSET", name, *pairs)

    def expire(self, name: str, time: int) -> None:
        self._add(name, "EXPIRE", name, int(time))

    def incr(self, name: str, amount: int = 1) -> None:
        self._add(name, "INCRBY", name, amount)

    def xack(self, name: str, groupname: str, *ids: str) -> None:
        self._acks.setdefault((name, groupname), []).extend(ids)

    def execute(self, raise_on_error: bool = True) -> list[Exception]:
        errors: list[Exception] = []
        if self._slots:
            groups = list(self._slots.values())
            pipe = self.client.pipeline(transaction=False)
            for keys, argv in groups:
                queue_script(pipe, "EVALSHA", _APPLY_SHA, keys, argv)
            results = pipe.execute(raise_on_error=False)
            missing = [i for i, res in enumerate(results) if isinstance(res, redis.exceptions.NoScriptError)]
            if missing:  # a master that has not seen the script yet (a new node, a restart): it did not run there
                pipe = self.client.pipeline(transaction=False)
                for i in missing:
                    keys, argv = groups[i]
                    queue_script(pipe, "EVAL", _APPLY_LUA, keys, argv)
                for i, res in zip(missing, pipe.execute(raise_on_error=False)):
                    results[i] = res
            for res in results:
                if isinstance(res, (redis.ConnectionError, redis.TimeoutError)):
                    raise res  # no ack goes out: the publisher retries the whole flush
                if isinstance(res, Exception):
                    errors.append(res)
                else:
                    errors.extend(redis.ResponseError(_b(e).decode("utf-8", "replace")) for e in res or [])
        if self._acks:
            pipe = self.client.pipeline(transaction=False)
            for (name, group), ids in self._acks.items():
                pipe.xack(name, group, *ids)
            for res in pipe.execute(raise_on_error=False):
                if isinstance(res, (redis.ConnectionError, redis.TimeoutError)):
                    raise res
                if isinstance(res, Exception):
                    errors.append(res)
        self._slots.clear()
        self._acks.clear()
        if errors and raise_on_error:
            raise errors[0]
        return errors

"""Compaction: part files -> exactly one line per input line, in shards, then the manifest.

Parts hold ``PartEntry`` lines written by workers (results) and by the
orchestrator (bad input lines). A job re-run after a crash may have its line in
two parts; compaction keys on the input line number (one job per valid line),
keeps one entry (a success over an error, then the first part in sorted order),
and writes records in input order. Memory stays bounded: entries are spilled to
temporary files by line range and each range is compacted on its own.

Shards and the manifest are written once (multipart + If-None-Match on S3,
``link()`` locally) from deterministic bytes, so re-running finalize after a
crash (same part list, recorded in the status hash) rewrites nothing. The
manifest is the commit point: a reader who sees it sees every shard it names.
Parts are removed only after the manifest exists.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

from pagestream.producer.bulk.parts import PartEntry
from pagestream.producer.bulk.storage import ObjectInfo
from pagestream.producer.bulk.stores import Storage

PARTS_PREFIX = "parts/"
#: the part a cancelled or expired bulk's finalize writes: an error line for every input line, used
#: only for a line no other part has (one never read, skipped, or still running when the bulk ended)
UNFINISHED_PART = f"{PARTS_PREFIX}~unfinished.jsonl"
MANIFEST = "manifest.json"
# input lines per spill file: bounds the dict held while deduplicating one range
_SPILL_RANGE_LINES = 4_096


def shard_name(kind: str, index: int) -> str:
    return f"{kind}-{index:05d}.jsonl"


class _ShardWriter:
    """Writes lines to local temp files and uploads each full shard write-once."""

    def __init__(self, storage: Storage, kind: str, shard_lines: int, tmpdir: str, on_upload: Callable[[], None]):
        self.storage, self.kind, self.shard_lines, self.tmpdir = storage, kind, shard_lines, tmpdir
        self.on_upload = on_upload
        self.shards: list[dict[str, Any]] = []
        self._f = None
        self._lines = 0

    def write(self, record: dict[str, Any]) -> None:
        if self._f is None:
            self._f = open(os.path.join(self.tmpdir, f"{self.kind}-{len(self.shards)}"), "wb")
        self._f.write((json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8"))
        self._lines += 1
        if self._lines >= self.shard_lines:
            self._upload()

    def _upload(self) -> None:
        assert self._f is not None
        path = self._f.name
        self._f.close()
        info: ObjectInfo = self.storage.put_file_once(shard_name(self.kind, len(self.shards)), path)
        os.unlink(path)
        self.shards.append({"name": info.name, "lines": self._lines, "bytes": info.size_bytes, "sha256": info.sha256})
        self._f, self._lines = None, 0
        self.on_upload()

    def close(self, always_one: bool = False) -> list[dict[str, Any]]:
        if self._f is None and always_one and not self.shards:
            self._f = open(os.path.join(self.tmpdir, f"{self.kind}-0"), "wb")
        if self._f is not None:
            self._upload()
        return self.shards


def list_parts(storage: Storage) -> list[str]:
    return sorted(n for n in storage.list(PARTS_PREFIX) if n.endswith(".jsonl"))


def compact(
    storage: Storage,
    parts: list[str],
    *,
    bulk_id: str,
    shard_lines: int,
    header: dict[str, Any],
    on_progress: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Write output/error shards and the manifest from ``parts``; returns the manifest.

    If the manifest already exists (finalize ran before and died during cleanup)
    it is returned as is.
    """
    existing = storage.read_bytes(MANIFEST)
    if existing is not None:
        return json.loads(existing)
    unfinished_orders = {order for order, name in enumerate(parts) if name == UNFINISHED_PART}
    with tempfile.TemporaryDirectory(prefix=f"pagestream-{bulk_id}-") as tmpdir:
        spills: dict[int, Any] = {}
        try:
            for order, name in enumerate(parts):
                for raw, _ in storage.open_lines(name):
                    if not raw.strip():
                        continue
                    line = json.loads(raw)["line"]
                    rng = line // _SPILL_RANGE_LINES
                    f = spills.get(rng)
                    if f is None:
                        f = spills[rng] = open(os.path.join(tmpdir, f"spill-{rng}"), "wb")
                    # prefix with the part's order so ties resolve the same way on every run
                    f.write(f"{order} ".encode() + raw + b"\n")
                on_progress()
        finally:
            for f in spills.values():
                f.close()

        outputs = _ShardWriter(storage, "output", shard_lines, tmpdir, on_progress)
        errors = _ShardWriter(storage, "errors", shard_lines, tmpdir, on_progress)
        n_ok = n_err = 0
        for rng in sorted(spills):
            # keep the raw line, not the parsed record: this dict is the only per-range memory
            best: dict[tuple[int, str], tuple[tuple[int, int], bytes]] = {}
            fallback: dict[int, bytes] = {}  # line -> its UNFINISHED_PART entry
            path = os.path.join(tmpdir, f"spill-{rng}")
            with open(path, "rb") as f:
                for raw in f:
                    order_s, payload = raw.split(b" ", 1)
                    entry = PartEntry.loads(payload)
                    if int(order_s) in unfinished_orders:
                        fallback.setdefault(entry.line, payload)
                        continue
                    rank = (0 if entry.ok else 1, int(order_s))
                    key = (entry.line, entry.custom_id or "")
                    cur = best.get(key)
                    if cur is None or rank < cur[0]:
                        best[key] = (rank, payload)
            os.unlink(path)
            have = {line for line, _ in best}
            for line, payload in fallback.items():
                if line not in have:
                    best[(line, "")] = ((2, 0), payload)
            for key in sorted(best):
                entry = PartEntry.loads(best[key][1])
                if entry.ok:
                    outputs.write(entry.record)
                    n_ok += 1
                else:
                    errors.write(entry.record)
                    n_err += 1
            del best
        output_shards = outputs.close(always_one=True)
        error_shards = errors.close()

        manifest = {
            **header,
            "bulk_id": bulk_id,
            "request_counts": {"total": n_ok + n_err, "completed": n_ok, "failed": n_err},
            "output_shards": output_shards,
            "error_shards": error_shards,
            "parts_compacted": len(parts),
        }
        path = os.path.join(tmpdir, MANIFEST)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.write("\n")
        storage.put_file_once(MANIFEST, path)
    return manifest


def remove_parts(storage: Storage) -> int:
    """Delete every part file (after the manifest is written), and what a part writer killed
    mid-write left beside them; returns how many parts."""
    names = list_parts(storage)
    storage.delete_many(names)
    storage.remove_abandoned(PARTS_PREFIX)
    return len(names)


def manifest_header(spec: Any, status: str) -> dict[str, Any]:
    # Only fields fixed before finalize starts, so a re-run writes identical manifest bytes.
    return {"object": "batch_manifest", "status": status, "input": spec.input, "output": spec.output,
            "model": spec.model, "created_at": spec.created_at}


__all__ = ["compact", "list_parts", "remove_parts", "manifest_header", "shard_name", "MANIFEST", "PARTS_PREFIX",
           "UNFINISHED_PART"]

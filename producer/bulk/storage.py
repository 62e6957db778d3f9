"""Where a bulk's files live: a local directory (the embedded default) or an S3 prefix.

Both give the same small interface the orchestrator and the bulk sink need:

- ``put_bytes``: a small object (a part file, a probe) that is durable when the
  call returns (local: temp file, fsync, rename; S3: a completed PUT).
- ``put_file_once``: a final shard or the manifest, written at most once. S3 uses
  a multipart upload completed with ``If-None-Match: *``; local uses ``link()``,
  which fails if the name exists. Either way a reader never sees half a file, and
  a re-run that writes the same bytes (same sha256) is a no-op instead of an error.
- ``list`` / ``open_lines`` / ``delete_many`` for compaction and cleanup.

The S3 side lives in ``producer/bulk/s3.py`` (boto3 is imported only when an
``s3://`` URI is used); ``producer/bulk/stores.py`` picks one for a URI.
"""
from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pagestream.producer.protocol.settings import ENV_PREFIX, S3_ADDRESSING_ENV, S3_ENDPOINT_ENV, S3_REGION_ENV

_READ_CHUNK_BYTES = 1024 * 1024


from pagestream.producer.protocol.bulk import AddressingStyle  # noqa: E402 (re-exported)


class StorageSettings(BaseSettings):
    """S3 client settings: ``PAGESTREAM_S3_*`` from the environment, the standard names
    (``S3_ENDPOINT_URL``, ``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``...) as aliases. A bulk's own
    endpoint, region and addressing style (given at submit) override these: ``BulkSpec.storage_settings``."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", populate_by_name=True)

    s3_endpoint_url: str | None = Field(None, validation_alias=AliasChoices(*S3_ENDPOINT_ENV))
    s3_region: str | None = Field(None, validation_alias=AliasChoices(*S3_REGION_ENV))
    s3_addressing_style: AddressingStyle | None = Field(None, validation_alias=AliasChoices(*S3_ADDRESSING_ENV))
    s3_max_attempts: int = 8  # botocore "standard" mode: exponential backoff with jitter
    s3_connect_timeout_s: float = 5.0
    s3_read_timeout_s: float = 30.0
    # extra rounds on top of botocore's, for a whole multipart upload or stream reopen
    s3_outer_retries: int = 3


class StorageError(RuntimeError):
    """A storage operation failed for good; ``permanent`` says retrying will not help."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class ConflictError(StorageError):
    """A write-once object already exists with different contents."""


@dataclass(slots=True)
class ObjectInfo:
    name: str
    size_bytes: int
    sha256: str


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_READ_CHUNK_BYTES), b""):
            h.update(chunk)
    return h.hexdigest()


def local_path(uri: str) -> Path:
    if uri.startswith("file://"):
        return Path(unquote(urlparse(uri).path))
    return Path(uri)


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


class LocalStorage:
    """A bulk's output in a local directory: the embedded default, no S3 needed."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.root = local_path(uri)

    def describe(self, name: str) -> str:
        return str(self.root / name)

    def check_writable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.put_bytes(".pagestream-probe", b"")
            (self.root / ".pagestream-probe").unlink()
        except OSError as exc:
            raise StorageError(f"output directory {self.root} is not writable: {exc}", permanent=True) from exc

    def check_readable(self, name: str = "") -> None:
        path = self.root / name if name else self.root
        if not path.exists():
            raise StorageError(f"input file {path} does not exist", permanent=True)

    def put_bytes(self, name: str, data: bytes) -> None:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _create_temp(path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        _fsync_dir(path.parent)

    def put_file_once(self, name: str, src: str | os.PathLike) -> ObjectInfo:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        digest = sha256_file(src)
        size = os.path.getsize(src)
        fd, tmp = _create_temp(path.parent)
        try:
            with os.fdopen(fd, "wb") as out, open(src, "rb") as f:
                for chunk in iter(lambda: f.read(_READ_CHUNK_BYTES), b""):
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            try:
                os.link(tmp, path)  # create-if-absent: the local If-None-Match
            except FileExistsError:
                if sha256_file(path) != digest:
                    raise ConflictError(f"{path} already exists with different contents", permanent=True) from None
        finally:
            os.unlink(tmp)
        _fsync_dir(path.parent)
        return ObjectInfo(name=name, size_bytes=size, sha256=digest)

    def exists(self, name: str) -> bool:
        return (self.root / name).exists()

    def read_bytes(self, name: str) -> bytes | None:
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> Iterator[str]:
        base = self.root / prefix
        directory = base if prefix.endswith("/") else base.parent
        if not directory.is_dir():
            return
        for p in sorted(directory.iterdir()):
            rel = p.relative_to(self.root).as_posix()
            if p.is_file() and rel.startswith(prefix) and not p.name.startswith(".tmp-"):
                yield rel

    def remove_abandoned(self, prefix: str) -> int:
        """Delete the temp files under ``prefix``'s directory that writers killed mid-write left
        (a write is a temp file renamed into place); for use once nobody writes there. Returns how many."""
        directory = self.root / prefix
        directory = directory if prefix.endswith("/") else directory.parent
        removed = 0
        for p in directory.glob(".tmp-*") if directory.is_dir() else ():
            try:
                p.unlink()
                removed += 1
            except FileNotFoundError:
                pass
        if removed and directory != self.root:
            try:
                directory.rmdir()  # only if empty
            except OSError:
                pass
        return removed

    def open_lines(self, name: str, offset: int = 0, max_line_bytes: int | None = None) -> Iterator[tuple[bytes, int]]:
        """Yield (line without newline, byte offset just past it), starting at ``offset`` (see ``split_lines``)."""
        with open(self.root / name, "rb") as f:
            f.seek(offset)
            yield from split_lines(iter(lambda: f.read(_READ_CHUNK_BYTES), b""), offset, max_line_bytes)

    def delete_many(self, names: Iterable[str]) -> None:
        dirs = set()
        for name in names:
            path = self.root / name
            dirs.add(path.parent)
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            if d != self.root:
                try:
                    d.rmdir()  # only if empty; S3 has no directories to leave behind
                except OSError:
                    pass


def split_lines(chunks: Iterable[bytes], offset: int = 0, max_line_bytes: int | None = None) -> Iterator[tuple[bytes, int]]:
    """(line without its newline, byte offset just past it) from a byte stream that starts at ``offset``.

    With ``max_line_bytes`` a longer line comes out cut to its first ``max_line_bytes + 1``
    bytes, so its reader can tell it is too long while memory stays bounded by the limit
    whatever the input holds; its offset still counts the whole line.
    """
    keep = None if max_line_bytes is None else max_line_bytes + 1
    pos = offset
    parts: list[bytes] = []
    held = size = 0  # bytes of the current line kept / seen

    def add(piece: bytes) -> None:
        nonlocal held, size
        size += len(piece)
        if keep is None or held < keep:
            piece = piece if keep is None else piece[: keep - held]
            parts.append(piece)
            held += len(piece)

    for chunk in chunks:
        *complete, rest = chunk.split(b"\n")
        for piece in complete:
            add(piece)
            pos += size + 1
            yield b"".join(parts).rstrip(b"\r"), pos
            parts.clear()
            held = size = 0
        add(rest)
    if size:
        yield b"".join(parts).rstrip(b"\r"), pos + size


def _create_temp(directory: Path) -> tuple[int, str]:
    """A new temp file in ``directory`` created 0666 less the umask, as ``open()`` would
    (``mkstemp`` makes 0600: a dataset the consuming group could not read)."""
    while True:
        path = os.path.join(directory, f".tmp-{secrets.token_hex(8)}")
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), path
        except FileExistsError:
            continue


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

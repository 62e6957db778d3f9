"""Where a bulk's files live: a local directory (the embedded default) or an S3 prefix.

Both give the same small interface the orchestrator and the bulk sink need:

- ``put_bytes``: a small object (a part file, a probe) that is durable when the
  call returns (local: temp file, fsync, rename; S3: a completed PUT).
- ``put_file_once``: a final shard or the manifest, written at most once. S3 uses
  a multipart upload completed with ``If-None-Match: *``; local uses ``link()``,
  which fails if the name exists. Either way a reader never sees half a file, and
  a re-run that writes the same bytes (same sha256) is a no-op instead of an error.
- ``list`` / ``open_lines`` / ``delete_many`` for compaction and cleanup.

Transient S3 errors (5xx, throttling, timeouts, dropped connections) are retried
by botocore's standard retry mode with exponential backoff; everything else is
raised as ``StorageError`` with a message that names the bucket and key.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from pydantic_settings import BaseSettings, SettingsConfigDict

# S3 needs >= 5 MiB for every part but the last; 8 MiB keeps memory flat.
MULTIPART_CHUNK_BYTES = 8 * 1024 * 1024
_READ_CHUNK_BYTES = 1024 * 1024
_PERMANENT_CODES = {
    "NoSuchBucket",
    "AccessDenied",
    "AllAccessDisabled",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccountProblem",
    "InvalidBucketName",
    "403",
    "404",
}


class StorageSettings(BaseSettings):
    """S3 client settings, from the environment (``S3_ENDPOINT_URL``, ...)."""

    model_config = SettingsConfigDict(extra="ignore")

    s3_endpoint_url: str | None = None
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


def split_s3_uri(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"not an s3:// URI: {uri!r} (expected s3://bucket/prefix)")
    return parsed.netloc, parsed.path.lstrip("/")


def local_path(uri: str) -> Path:
    if uri.startswith("file://"):
        return Path(unquote(urlparse(uri).path))
    return Path(uri)


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def make_s3_client(settings: StorageSettings | None = None, endpoint_url: str | None = None):
    import boto3
    from botocore.config import Config

    settings = settings or StorageSettings()
    config = Config(
        retries={"mode": "standard", "max_attempts": settings.s3_max_attempts},
        connect_timeout=settings.s3_connect_timeout_s,
        read_timeout=settings.s3_read_timeout_s,
    )
    return boto3.client("s3", endpoint_url=endpoint_url or settings.s3_endpoint_url, config=config)


def _error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    err = response.get("Error", {}) or {}
    return str(err.get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode") or "")


def _is_permanent(exc: Exception) -> bool:
    return _error_code(exc) in _PERMANENT_CODES


def _is_transient(exc: Exception) -> bool:
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError, ReadTimeoutError

    if isinstance(exc, ClientError):
        code = _error_code(exc)
        return code in {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "500", "502", "503", "504"}
    return isinstance(exc, (ConnectionError, HTTPClientError, ReadTimeoutError))


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
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
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
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
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

    def open_lines(self, name: str, offset: int = 0) -> Iterator[tuple[bytes, int]]:
        """Yield (line without newline, byte offset just past it), starting at ``offset``."""
        with open(self.root / name, "rb") as f:
            f.seek(offset)
            pos = offset
            for line in f:
                pos += len(line)
                yield line.rstrip(b"\r\n"), pos

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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class S3Storage:
    """A bulk's output under ``s3://bucket/prefix/`` through boto3 (any S3-compatible endpoint)."""

    def __init__(self, uri: str, settings: StorageSettings | None = None, client=None) -> None:
        self.uri = uri
        self.settings = settings or StorageSettings()
        self.bucket, prefix = split_s3_uri(uri)
        self.prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        self.client = client or make_s3_client(self.settings)

    def key(self, name: str) -> str:
        return self.prefix + name

    def describe(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.key(name)}"

    def _fail(self, what: str, name: str, exc: Exception) -> StorageError:
        code = _error_code(exc)
        detail = f"{code}: {exc}" if code else repr(exc)
        return StorageError(f"S3 {what} {self.describe(name)} failed ({detail})", permanent=_is_permanent(exc))

    def check_writable(self) -> None:
        """Fail fast (before any job is queued) on a missing bucket or denied access."""
        name = ".pagestream-probe"
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            code = _error_code(exc)
            if code in {"404", "NoSuchBucket", "NotFound"}:
                raise StorageError(f"bucket {self.bucket!r} does not exist (NoSuchBucket)", permanent=True) from exc
            if code in {"403", "AccessDenied"}:
                raise StorageError(f"access denied to bucket {self.bucket!r} (AccessDenied)", permanent=True) from exc
            err = self._fail("HEAD bucket", "", exc)
            err.permanent = err.permanent or not _is_transient(exc)
            raise err from exc
        try:
            self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=b"")
            self.client.delete_object(Bucket=self.bucket, Key=self.key(name))
        except Exception as exc:
            err = self._fail("write probe", name, exc)
            err.permanent = err.permanent or not _is_transient(exc)
            raise err from exc

    def check_readable(self, name: str = "") -> None:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.key(name))
        except Exception as exc:
            err = self._fail("read", name, exc)
            err.permanent = err.permanent or not _is_transient(exc)
            raise err from exc

    def put_bytes(self, name: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=data)
        except Exception as exc:
            raise self._fail("PUT", name, exc) from exc

    def _head(self, name: str) -> dict | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self.key(name))
        except ClientError as exc:
            if _error_code(exc) in {"404", "NoSuchKey", "NotFound"}:
                return None
            raise

    def exists(self, name: str) -> bool:
        return self._head(name) is not None

    def _same_object(self, name: str, digest: str) -> bool:
        head = self._head(name)
        if head is None:
            return False
        if head.get("Metadata", {}).get("sha256") != digest:
            raise ConflictError(f"{self.describe(name)} already exists with different contents", permanent=True)
        return True

    def put_file_once(self, name: str, src: str | os.PathLike) -> ObjectInfo:
        """Multipart upload completed with If-None-Match: '*'; a lost response is resolved by sha256."""
        digest = sha256_file(src)
        size = os.path.getsize(src)
        info = ObjectInfo(name=name, size_bytes=size, sha256=digest)
        last: Exception | None = None
        for attempt in range(self.settings.s3_outer_retries + 1):
            try:
                if self._same_object(name, digest):
                    return info
                self._multipart_upload(name, src, digest)
                return info
            except ConflictError:
                raise
            except Exception as exc:
                from botocore.exceptions import ClientError

                # 412: someone (or our own earlier, lost-response attempt) wrote it first.
                if isinstance(exc, ClientError) and _error_code(exc) in {"PreconditionFailed", "412", "NoSuchUpload"}:
                    if self._same_object(name, digest):
                        return info
                if _is_permanent(exc) or not _is_transient(exc):
                    raise self._fail("multipart upload", name, exc) from exc
                last = exc
                time.sleep(min(0.5 * 2**attempt, 8.0))
        raise self._fail("multipart upload", name, last)  # type: ignore[arg-type]

    def _multipart_upload(self, name: str, src: str | os.PathLike, digest: str) -> None:
        key = self.key(name)
        upload = self.client.create_multipart_upload(
            Bucket=self.bucket, Key=key, Metadata={"sha256": digest}, ContentType="application/x-ndjson"
        )
        upload_id = upload["UploadId"]
        try:
            parts = []
            with open(src, "rb") as f:
                number = 1
                while True:
                    chunk = f.read(MULTIPART_CHUNK_BYTES)
                    if not chunk and number > 1:
                        break
                    resp = self.client.upload_part(
                        Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=chunk
                    )
                    parts.append({"PartNumber": number, "ETag": resp["ETag"]})
                    number += 1
                    if len(chunk) < MULTIPART_CHUNK_BYTES:
                        break
            self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                IfNoneMatch="*",
            )
        except BaseException:
            # Abort so no orphaned parts linger; the object itself never became visible.
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except Exception:
                pass
            raise

    def read_bytes(self, name: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.key(name))["Body"].read()
        except ClientError as exc:
            if _error_code(exc) in {"404", "NoSuchKey"}:
                return None
            raise self._fail("GET", name, exc) from exc

    def list(self, prefix: str) -> Iterator[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.key(prefix)):
                for obj in page.get("Contents", []):
                    yield obj["Key"][len(self.prefix):]
        except Exception as exc:
            raise self._fail("LIST", prefix, exc) from exc

    def open_lines(self, name: str, offset: int = 0) -> Iterator[tuple[bytes, int]]:
        """Stream (line, byte offset just past it) from ``offset``; a dropped stream reopens at the last line."""
        pos = offset
        failures = 0
        while True:
            try:
                kwargs = {"Range": f"bytes={pos}-"} if pos else {}
                try:
                    body = self.client.get_object(Bucket=self.bucket, Key=self.key(name), **kwargs)["Body"]
                except Exception as exc:
                    if _error_code(exc) == "InvalidRange":
                        return  # offset is at the end of the object
                    raise
                pending = b""
                for chunk in iter(lambda: body.read(_READ_CHUNK_BYTES), b""):
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        pos += len(line) + 1
                        yield line.rstrip(b"\r"), pos
                        failures = 0
                if pending:
                    pos += len(pending)
                    yield pending.rstrip(b"\r"), pos
                return
            except Exception as exc:
                if not _is_transient(exc) or failures >= self.settings.s3_outer_retries:
                    raise self._fail("GET", name, exc) from exc
                failures += 1
                time.sleep(min(0.5 * 2**failures, 8.0))

    def delete_many(self, names: Iterable[str]) -> None:
        batch: list[dict] = []
        for name in names:
            batch.append({"Key": self.key(name)})
            if len(batch) == 1000:
                self._delete(batch)
                batch = []
        if batch:
            self._delete(batch)

    def _delete(self, batch: list[dict]) -> None:
        try:
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
        except Exception as exc:
            raise self._fail("DELETE", batch[0]["Key"], exc) from exc


Storage = LocalStorage | S3Storage


def open_storage(uri: str, settings: StorageSettings | None = None, client=None) -> Storage:
    """The storage for a bulk output URI: ``s3://bucket/prefix``, ``file:///dir`` or a plain path."""
    if is_s3(uri):
        return S3Storage(uri, settings=settings, client=client)
    if "://" in uri and not uri.startswith("file://"):
        raise ValueError(f"unsupported output URI {uri!r}: use s3://bucket/prefix, file:///dir or a local path")
    return LocalStorage(uri)


def open_input(uri: str, settings: StorageSettings | None = None) -> tuple[Storage, str]:
    """(storage, object name) for an input file URI, so it can be streamed with ``open_lines``."""
    if is_s3(uri):
        bucket, key = split_s3_uri(uri)
        if not key:
            raise ValueError(f"input URI {uri!r} names a bucket, not an object")
        return S3Storage(f"s3://{bucket}", settings=settings), key
    path = local_path(uri)
    return LocalStorage(str(path.parent)), path.name

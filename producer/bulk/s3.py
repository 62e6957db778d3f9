"""A bulk's files under ``s3://bucket/prefix/`` through boto3 (AWS, MinIO, moto: ``endpoint_url``).

Transient S3 errors (5xx, throttling, timeouts, dropped connections) are retried
by botocore's standard retry mode with exponential backoff, and a whole
multipart upload or input stream gets a few more rounds on top; everything else
is raised as ``StorageError`` with a message that names the bucket and key, and
``permanent=True`` for a missing bucket or denied access.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from urllib.parse import urlparse

from pagestream.producer.bulk.storage import (
    _READ_CHUNK_BYTES,
    ConflictError,
    ObjectInfo,
    StorageError,
    StorageSettings,
    sha256_file,
    split_lines,
)

# S3 needs >= 5 MiB for every part but the last; 8 MiB keeps memory flat.
MULTIPART_CHUNK_BYTES = 8 * 1024 * 1024
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


def split_s3_uri(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"not an s3:// URI: {uri!r} (expected s3://bucket/prefix)")
    return parsed.netloc, parsed.path.lstrip("/")


def make_s3_client(settings: StorageSettings | None = None, endpoint_url: str | None = None):
    import boto3
    from botocore.config import Config

    settings = settings or StorageSettings()
    config = Config(
        retries={"mode": "standard", "max_attempts": settings.s3_max_attempts},
        connect_timeout=settings.s3_connect_timeout_s,
        read_timeout=settings.s3_read_timeout_s,
        s3={"addressing_style": settings.s3_addressing_style} if settings.s3_addressing_style else None,
    )
    return boto3.client("s3", endpoint_url=endpoint_url or settings.s3_endpoint_url, region_name=settings.s3_region,
                        config=config)


def _error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    err = response.get("Error", {}) or {}
    return str(err.get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode") or "")


def _is_permanent(exc: Exception) -> bool:
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError

    # no credentials at all: botocore raises before any request, and no retry will find some
    return isinstance(exc, (NoCredentialsError, PartialCredentialsError)) or _error_code(exc) in _PERMANENT_CODES


def _is_transient(exc: Exception) -> bool:
    from botocore.exceptions import (
        ClientError,
        ConnectionError,
        HTTPClientError,
        IncompleteReadError,
        ReadTimeoutError,
    )
    from urllib3.exceptions import HTTPError as Urllib3Error

    if isinstance(exc, ClientError):
        code = _error_code(exc)
        return code in {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "500", "502", "503", "504"}
    # a streamed GET body dropped mid-read (e.g. an input stream left idle while throttled)
    return isinstance(exc, (ConnectionError, HTTPClientError, ReadTimeoutError, IncompleteReadError, Urllib3Error))


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
            if _error_code(exc) in {"404", "NoSuchKey", "NoSuchBucket"}:
                raise StorageError(f"{self.describe(name)} does not exist", permanent=True) from exc
            err = self._fail("read", name, exc)
            err.permanent = err.permanent or not _is_transient(exc)
            raise err from exc

    def put_bytes(self, name: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=data)
        except Exception as exc:
            err = self._fail("PUT", name, exc)
            err.permanent = err.permanent or not _is_transient(exc)
            raise err from exc

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

    def open_lines(self, name: str, offset: int = 0, max_line_bytes: int | None = None) -> Iterator[tuple[bytes, int]]:
        """Stream (line, byte offset just past it) from ``offset`` (see ``split_lines``); a dropped
        stream reopens after the last whole line."""
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
                for line, end in split_lines(iter(lambda: body.read(_READ_CHUNK_BYTES), b""), pos, max_line_bytes):
                    pos = end
                    yield line, end
                    failures = 0
                return
            except Exception as exc:
                if not _is_transient(exc) or failures >= self.settings.s3_outer_retries:
                    raise self._fail("GET", name, exc) from exc
                failures += 1
                time.sleep(min(0.5 * 2**failures, 8.0))

    def remove_abandoned(self, prefix: str) -> int:
        """Nothing to do: a part is one PUT, which S3 makes whole or not at all."""
        return 0

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

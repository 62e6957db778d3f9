"""Which storage a bulk URI names: ``open_storage`` for an output prefix, ``open_input`` for an input file.

The factory sits above both backends (``storage.LocalStorage``, ``s3.S3Storage``), so neither
backend module imports the other; boto3 is still imported only when an ``s3://`` URI is opened.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Union

from pagestream.producer.bulk.storage import LocalStorage, StorageSettings, is_s3, local_path
from pagestream.producer.protocol.bulk import BulkSpec

if TYPE_CHECKING:
    from pagestream.producer.bulk.s3 import S3Storage

#: either backend; both have the same methods
Storage = Union[LocalStorage, "S3Storage"]


def open_storage(uri: str, settings: StorageSettings | None = None, client=None) -> Storage:
    """The storage for a bulk output URI: ``s3://bucket/prefix``, ``file:///dir`` or a plain path."""
    if is_s3(uri):
        from pagestream.producer.bulk.s3 import S3Storage

        return S3Storage(uri, settings=settings, client=client)
    if "://" in uri and not uri.startswith("file://"):
        raise ValueError(f"unsupported output URI {uri!r}: use s3://bucket/prefix, file:///dir or a local path")
    return LocalStorage(uri)


def open_input(uri: str, settings: StorageSettings | None = None) -> tuple[Storage, str]:
    """(storage, object name) for an input file URI, so it can be streamed with ``open_lines``."""
    if is_s3(uri):
        from pagestream.producer.bulk.s3 import S3Storage, split_s3_uri

        bucket, key = split_s3_uri(uri)
        if not key:
            raise ValueError(f"input URI {uri!r} names a bucket, not an object")
        return S3Storage(f"s3://{bucket}", settings=settings), key
    path = local_path(uri)
    return LocalStorage(str(path.parent)), path.name


def storage_settings_for(spec: BulkSpec, base: StorageSettings | None = None) -> StorageSettings:
    """``base`` (default: this process's environment) with the bulk's own S3 location on top."""
    mine = {k: getattr(spec, k) for k in ("s3_endpoint_url", "s3_region", "s3_addressing_style") if getattr(spec, k)}
    return (base or StorageSettings()).model_copy(update=mine)

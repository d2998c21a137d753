"""Checkpoint storage: one interface, one module per backend, chosen by URL scheme.

>>> from ckpt_agent.storage import open_storage
>>> store = open_storage("/mnt/ckpt")                  # or file:///mnt/ckpt
>>> store = open_storage("s3://bucket/prefix")         # options from CKPT_S3_* env vars

Built-in schemes: a plain path or ``file://`` (:mod:`ckpt_agent.storage.fs`)
and ``s3://bucket/prefix`` (:mod:`ckpt_agent.storage.s3`, needs boto3, which
is imported only when an ``s3://`` URL is opened). Other schemes come from
the entry-point group ``ckpt_agent.storage``: the entry point's name is the
scheme, its object either a :class:`Storage` subclass implementing
:meth:`Storage.from_url` or a callable ``(url, options) -> Storage``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import cast
from urllib.parse import urlsplit

from ckpt_agent.errors import (
    NotFoundError,
    PermanentStorageError,
    RetryableStorageError,
    StorageError,
)
from ckpt_agent.storage.base import (
    ObjectInfo,
    ObjectWriter,
    Storage,
    WriteLatencyHook,
    validate_key,
)
from ckpt_agent.storage.options import StorageOptions

__all__ = [
    "ENTRY_POINT_GROUP",
    "NotFoundError",
    "ObjectInfo",
    "ObjectWriter",
    "PermanentStorageError",
    "RetryableStorageError",
    "Storage",
    "StorageError",
    "StorageOptions",
    "WriteLatencyHook",
    "open_storage",
    "validate_key",
]

ENTRY_POINT_GROUP = "ckpt_agent.storage"

#: Built-in backends ("module:attribute"), used even when the package's entry
#: points are not installed (running from a source checkout).
_BUILTIN: dict[str, str] = {
    "file": "ckpt_agent.storage.fs:LocalStorage",
    "s3": "ckpt_agent.storage.s3:S3Storage",
}

_Factory = Callable[[str, StorageOptions | None], Storage]


def _scheme_of(url: str) -> str:
    scheme = urlsplit(url).scheme.lower()
    # A one-letter "scheme" is a Windows drive (C:\...): a path.
    return "file" if len(scheme) <= 1 else scheme


def _load(target: str) -> object:
    module, _, attr = target.partition(":")
    obj: object = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _factory_for(scheme: str) -> _Factory:
    obj: object | None = None
    if scheme in _BUILTIN:
        obj = _load(_BUILTIN[scheme])
    else:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name == scheme:
                obj = ep.load()
                break
    if obj is None:
        known = sorted({*_BUILTIN, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})
        raise ValueError(
            f"no storage backend for scheme {scheme!r}; known: {', '.join(known)} "
            f"(third-party backends register in the entry-point group {ENTRY_POINT_GROUP!r})"
        )
    if isinstance(obj, type) and issubclass(obj, Storage):
        return obj.from_url
    if callable(obj):
        return cast(_Factory, obj)
    raise TypeError(f"storage entry point {scheme!r} is neither a Storage class nor a factory")


def open_storage(url: str, options: StorageOptions | None = None) -> Storage:
    """Open the backend for ``url``.

    ``options`` default to :meth:`StorageOptions.from_env` (``CKPT_S3_*``,
    ``CKPT_FS_*``). Raises ``ValueError`` for a malformed URL or unknown scheme
    and ``ImportError`` (saying what to install) when a backend's SDK is missing.
    """
    if not url:
        raise ValueError("empty storage URL")
    if options is None:
        options = StorageOptions.from_env()
    return _factory_for(_scheme_of(url))(url, options)

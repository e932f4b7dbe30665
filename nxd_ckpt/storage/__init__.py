"""Storage backends behind one byte-level interface (``base.Storage``): POSIX filesystems (local, FSx for
Lustre, NFS) and S3. Two more object stores exist for tests (an in-memory one, ``mem://``, and a
shared-directory one, ``objdir://``); their URLs are refused unless a test enabled them through
``nxd_ckpt.storage.testing.enable_test_schemes()``, so a user can never save into process memory by accident."""
from __future__ import annotations

import os
from typing import Optional

from .base import AlreadyExistsError, Capabilities, FileRecord, Stat, Storage, set_write_hook
from .local import LocalStorage
from .objects import ObjectStorage

#: object-store schemes served only after ``testing.enable_test_schemes()`` (tests and development)
TEST_SCHEMES = ("mem", "objdir")
#: the subset of TEST_SCHEMES this process enabled; empty unless a test asked
_ENABLED_TEST_SCHEMES: set = set()
_S3_BUCKETS: dict = {}


def check_location(path) -> str:
    """``path`` as a string, or CheckpointArgumentError when it is a URL whose scheme no backend here serves.
    Every entry point and tool calls this first."""
    text = os.fspath(path) if not isinstance(path, str) and hasattr(path, "__fspath__") else path
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if isinstance(text, str) and "://" in text:
        scheme = text.split("://", 1)[0]
        from ..errors import CheckpointArgumentError

        if scheme != "s3" and scheme not in _ENABLED_TEST_SCHEMES:
            raise CheckpointArgumentError(
                f"{text!r} is a {scheme}:// URL, which nxd-ckpt does not serve: pass a POSIX path (local disk, FSx "
                "for Lustre, NFS) or an s3://bucket/prefix URL.")
    return text


def open_storage(root: str, *, timeout_s: Optional[float] = None, workers: Optional[int] = None,
                 s3_client=None, endpoint_url: Optional[str] = None) -> Storage:
    """The Storage for a checkpoint directory path or URL: ``s3://bucket/prefix`` is S3 (boto3; credentials,
    region and endpoint from the AWS configuration chain, or ``s3_client`` / ``endpoint_url``; every
    request retried until ``timeout_s``, which is one deadline for every request made through the returned
    Storage when given, e.g. a whole save or load, and per request when not); ``mem://bucket/prefix`` and ``objdir:///dir`` are object stores
    for tests, served only once ``testing.enable_test_schemes()`` ran in this process; any other
    ``scheme://`` is refused by ``check_location``; everything else is a POSIX path."""
    text = check_location(root)
    scheme = text.split("://", 1)[0] if "://" in text else ""
    if scheme == "s3":
        return _open_s3(text, timeout_s, workers, s3_client, endpoint_url)
    if scheme in _ENABLED_TEST_SCHEMES:
        from .objects import open_object_url

        return open_object_url(text)
    return LocalStorage(text)


def _open_s3(url: str, timeout_s, workers, client, endpoint_url) -> Storage:
    """One S3Bucket (client and part pool) per bucket and settings in this process, reused by every save."""
    from .s3 import DEFAULT_TIMEOUT_S, S3Bucket, parse_s3_url

    try:
        bucket, prefix = parse_s3_url(url)
    except ValueError as exc:
        from ..errors import CheckpointArgumentError

        raise CheckpointArgumentError(str(exc)) from None
    key = (bucket, timeout_s or DEFAULT_TIMEOUT_S, workers or 8, id(client) if client else None, endpoint_url)
    if key not in _S3_BUCKETS:
        _S3_BUCKETS[key] = S3Bucket(bucket, client=client, endpoint_url=endpoint_url,
                                    timeout_s=timeout_s or DEFAULT_TIMEOUT_S, workers=workers or 8)
    shared = _S3_BUCKETS[key]
    return ObjectStorage(shared.with_deadline(timeout_s) if timeout_s else shared, prefix, url)


def forget_clients() -> None:
    """In a process forked from one that used S3: drop the inherited clients and part pools (their
    connections and threads belong to the parent), so the next ``open_storage`` makes fresh ones."""
    _S3_BUCKETS.clear()


__all__ = ["AlreadyExistsError", "Capabilities", "FileRecord", "Stat", "Storage", "LocalStorage", "ObjectStorage",
           "check_location", "forget_clients", "open_storage", "set_write_hook"]

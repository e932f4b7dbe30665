"""Amazon S3 (and S3-compatible servers) as a Bucket for ObjectStorage, on boto3.

Keys are NxD's: ``<prefix>/`` + the same relative paths as on disk, no directory placeholder objects.
Every object is uploaded with the CRC32C computed while it was produced, sent as S3's CRC32C checksum, so
the server rejects a damaged upload. Objects larger than one part go up as a multipart upload whose parts
are sent in parallel while the file is still being produced; reads of large objects are parallel ranged
GETs. Every request is retried on throttling (SlowDown, 503), server errors (500), request timeouts and
dropped connections with capped exponential backoff and full jitter, until a deadline; then the call
raises ``S3Error`` (an OSError) naming the operation, the key and the last error. A view made by
``with_deadline`` (one per save or load) shares one absolute deadline across all its requests: no attempt
starts after it, and each attempt's connect and read timeouts are capped so that a silent server cannot hold
it past the deadline. Without a view each request gets its own ``timeout_s``. Credentials, region and endpoint come from the standard AWS chain (environment, profiles,
``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``) unless a client or endpoint is passed.
"""
from __future__ import annotations

import base64
import copy
import math
import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Tuple

import crc32c as _crc32c

from .base import AlreadyExistsError, FileRecord, Sink, Stat
from .objects import Bucket

PART_SIZE = 16 << 20          # the first parts' size, and the threshold for a multipart upload
PARTS_PER_SIZE = 1000         # every this many parts the part size doubles (S3: at most 10,000 parts)
MAX_PART_SIZE = 5 << 30       # S3's largest part
RANGE_SIZE = 32 << 20         # ranged GET size for large objects
DEFAULT_TIMEOUT_S = 1800.0
BACKOFF_BASE_S = 0.1
BACKOFF_CAP_S = 5.0
CONNECT_TIMEOUT_S = 10.0      # the uncapped client's socket timeouts
READ_TIMEOUT_S = 60.0
MIN_ATTEMPT_S = 0.25          # with less time left than this before the deadline no attempt starts

_RETRY_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                "InternalError", "ServiceUnavailable", "503", "500", "502", "504", "RequestLimitExceeded"}


class S3Error(OSError):
    """An S3 request failed for good (not retryable, or retried until the deadline)."""


class _RangeNotSatisfiable(S3Error):
    """A ranged GET that starts at or past the object's end (S3's 416 InvalidRange)."""


def part_size(number: int) -> int:
    """The size of part ``number`` (1-based) of a multipart upload, the last one excepted. Small parts keep
    the upload close behind the producer (the last part's upload is a tail after the file is produced);
    doubling every PARTS_PER_SIZE parts keeps a file of up to S3's 5 TB object limit within 10,000 parts."""
    return min(MAX_PART_SIZE, PART_SIZE << ((number - 1) // PARTS_PER_SIZE))


def _b64_crc(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


class S3Bucket(Bucket):
    """One S3 bucket. ``workers`` bounds the parallel part uploads / ranged GETs of this process."""

    def __init__(self, name: str, *, client=None, endpoint_url: Optional[str] = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, workers: int = 8):
        self.name = name
        self.timeout_s = float(timeout_s)
        self.endpoint_url = endpoint_url
        self._own_client = client is None
        self.client = client if client is not None else make_client(endpoint_url, self.timeout_s)
        self.workers = max(1, int(workers))
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="nxd_ckpt-s3")
        self.requests: Dict[str, int] = {}
        self._lock = threading.Lock()
        self._capped: Dict[float, object] = {}     # socket timeout -> client, shared by every view
        self.deadline: Optional[float] = None       # time.monotonic() value; set on views only
        self.last_attempt_at: Optional[float] = None  # when this view's newest attempt started
        self.last_view: Optional["S3Bucket"] = None   # the newest view (for tests and diagnostics)

    def with_deadline(self, timeout_s: float) -> "S3Bucket":
        """A view sharing this bucket's client, pool and counters whose every request, retries included,
        ends by ``time.monotonic() + timeout_s`` (measured now). One per save or load."""
        view = copy.copy(self)
        view.deadline = time.monotonic() + float(timeout_s)
        view.timeout_s = float(timeout_s)
        view.last_attempt_at = None
        self.last_view = view
        return view

    def _client_for(self, remaining: float):
        """(client, its socket timeout or 0 when uncapped): a client whose connect and read timeouts each fit
        in half the time left (a power of two, so a handful of clients serve a whole save), so a connect
        plus one stalled read end by the deadline. A caller's own client is never capped."""
        if not self._own_client or remaining >= 2 * READ_TIMEOUT_S:
            return self.client, 0.0
        cap = 2.0 ** math.floor(math.log2(remaining / 2))
        with self._lock:
            if cap not in self._capped:
                self._capped[cap] = make_client(self.endpoint_url, cap, connect_s=cap, read_s=cap)
            return self._capped[cap], cap

    # --- retries ------------------------------------------------------------------------------------
    def call(self, op: str, key: str, fn: Optional[Callable] = None, **kw):
        """``client.<op>(Bucket=..., **kw)`` (or ``fn(client, Bucket=..., **kw)``) with retries until the deadline
        (this view's, else ``timeout_s`` from now), on a client whose socket timeouts fit in the time left."""
        from botocore.exceptions import ClientError

        deadline = self.deadline if self.deadline is not None else time.monotonic() + self.timeout_s
        attempt = 0
        last = "none started"
        while True:
            now = time.monotonic()
            if deadline - now < MIN_ATTEMPT_S:
                raise S3Error(f"S3 {op} of s3://{self.name}/{key} did not succeed within {self.timeout_s:.0f}s "
                              f"({attempt} attempts; last: {last}); check the endpoint, throttling and network")
            client, cap = self._client_for(deadline - now)
            now = time.monotonic()
            if 2 * cap > deadline - now:
                continue  # making the client took time: take the next smaller class (or give up)
            attempt += 1
            with self._lock:
                self.requests[op] = self.requests.get(op, 0) + 1
                self.last_attempt_at = now
            try:
                return fn(client, Bucket=self.name, **kw) if fn else getattr(client, op)(Bucket=self.name, **kw)
            except ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if code in ("NoSuchKey", "404", "NotFound"):
                    raise FileNotFoundError(f"s3://{self.name}/{key}") from None
                if code == "PreconditionFailed" or status == 412:
                    raise AlreadyExistsError(f"s3://{self.name}/{key} already exists") from None
                if code == "InvalidRange" or status == 416:
                    raise _RangeNotSatisfiable(f"s3://{self.name}/{key}: {kw.get('Range')} starts past its end")
                if code not in _RETRY_CODES and status not in (500, 502, 503, 504):
                    raise S3Error(f"S3 {op} of s3://{self.name}/{key} failed: {code}: {exc}") from exc
                last = f"{code} (HTTP {status})"
            except _transient_errors() as exc:
                last = f"{type(exc).__name__}: {exc}"
            pause = random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (attempt - 1)))
            time.sleep(max(0.0, min(pause, deadline - time.monotonic())))

    # --- Bucket ---------------------------------------------------------------------------------------
    def put(self, key: str, data: bytes, crc32c: int, if_none_match: bool = False) -> None:
        kw = {"IfNoneMatch": "*"} if if_none_match else {}
        self.call("put_object", key, Key=key, Body=data, ChecksumAlgorithm="CRC32C",
                  ChecksumCRC32C=_b64_crc(crc32c), **kw)

    def sink(self, key: str, exclusive: bool) -> Sink:
        return _MultipartSink(self, key, exclusive)

    def get(self, key: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        if length is None:
            return self._get_to_end(key, offset)
        if length == 0:
            return b""
        return self._read_body(key, Range=f"bytes={offset}-{offset + length - 1}")

    def _read_body(self, key: str, **kw) -> bytes:
        # The body is read inside the retried call: a connection dropped mid-body is retried as well.
        def get_and_read(client, **args):
            return client.get_object(**args)["Body"].read()

        return self.call("get_object", key, fn=get_and_read, Key=key, **kw)

    def _get_to_end(self, key: str, offset: int) -> bytes:
        """From ``offset`` to the end without asking the size first (no HEAD): one ranged GET of up to
        RANGE_SIZE bytes, whose Content-Range names the object's size; a larger object's other ranges are
        requested in parallel as soon as that response's headers arrive, while its body is read."""
        first = f"bytes={offset}-{offset + RANGE_SIZE - 1}"
        try:
            resp = self.call("get_object", key, Key=key, Range=first)
        except _RangeNotSatisfiable:
            return b""                  # an empty object, or offset at or past the end
        size = int(resp["ContentRange"].rsplit("/", 1)[1])
        length = max(0, size - offset)
        if length <= RANGE_SIZE:
            return self._read_first(key, resp, first)
        # The ranges are joined once at the end: no zero-filled buffer of the whole object before the first
        # request (its page faults delayed the other ranges) and one copy per byte, not two.
        ends = [(o, min(o + RANGE_SIZE, length) - 1) for o in range(RANGE_SIZE, length, RANGE_SIZE)]
        futures = [self._pool.submit(self._read_body, key, Range=f"bytes={offset + a}-{offset + b}") for a, b in ends]
        head = self._read_first(key, resp, first)
        return b"".join([head] + [f.result() for f in futures])

    def _read_first(self, key: str, resp: dict, rng: str) -> bytes:
        """The body of a response whose headers ``call`` returned; a body dropped midway is fetched again
        through the retries (and the deadline)."""
        try:
            return resp["Body"].read()
        except _transient_errors():
            return self._read_body(key, Range=rng)

    def get_into(self, key: str, view: memoryview, offset: int = 0,
                 on_range: Optional[Callable[[int, int], None]] = None) -> int:
        """Parallel ranged GETs of RANGE_SIZE, each response body read straight into its slice of ``view`` (no
        bytes object per range, no join): the first range's Content-Range names the object's size (no HEAD),
        the others are requested as soon as its headers arrive. A body dropped midway is fetched again.
        ``on_range(start, end)`` is called (from the thread that read it) as each range of ``view`` is filled."""
        view = memoryview(view).cast("B")
        if not len(view):
            return 0
        first = min(len(view), RANGE_SIZE)
        try:
            resp = self.call("get_object", key, Key=key, Range=f"bytes={offset}-{offset + first - 1}")
        except _RangeNotSatisfiable:
            return 0                    # an empty object, or offset at or past the end
        size = int(resp["ContentRange"].rsplit("/", 1)[1])
        total = max(0, min(len(view), size - offset))
        futures = [self._pool.submit(self._range_into, key, view, a, min(a + RANGE_SIZE, total), offset, on_range)
                   for a in range(first, total, RANGE_SIZE)]
        head = view[:min(first, total)]
        try:
            _body_into(resp["Body"], head)
        except _transient_errors():
            self._range_into(key, view, 0, len(head), offset)
        if on_range is not None:
            on_range(0, len(head))
        for f in futures:
            f.result()
        return total

    def _range_into(self, key: str, view: memoryview, start: int, end: int, offset: int,
                    on_range: Optional[Callable[[int, int], None]] = None) -> None:
        """``view[start:end]`` from the object's bytes at ``offset + start``."""
        part = view[start:end]

        def get_and_fill(client, **args):   # the body is read inside the retried call, as in _read_body
            _body_into(client.get_object(**args)["Body"], part)

        self.call("get_object", key, fn=get_and_fill, Key=key, Range=f"bytes={offset + start}-{offset + end - 1}")
        if on_range is not None:
            on_range(start, end)

    def head(self, key: str) -> Stat:
        resp = self.call("head_object", key, Key=key)
        return Stat(int(resp["ContentLength"]), resp["LastModified"].timestamp())

    def list_page(self, prefix: str, after: Optional[str],
                  limit: Optional[int] = None) -> Tuple[List[Tuple[str, Stat]], Optional[str]]:
        kw = {"Prefix": prefix, "MaxKeys": min(self.page_size, limit or self.page_size)}
        if after is not None:
            kw["ContinuationToken"] = after
        resp = self.call("list_objects_v2", prefix, **kw)
        entries = [(o["Key"], Stat(int(o["Size"]), o["LastModified"].timestamp())) for o in resp.get("Contents", [])]
        return entries, (resp.get("NextContinuationToken") if resp.get("IsTruncated") else None)

    def delete_batch(self, keys: List[str]) -> None:
        if not keys:
            return
        resp = self.call("delete_objects", keys[0], Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})
        errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
        if errors:
            e = errors[0]
            raise S3Error(f"S3 delete_objects failed for {len(errors)} key(s), e.g. s3://{self.name}/{e.get('Key')}: "
                          f"{e.get('Code')}: {e.get('Message')}")

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class _MultipartSink(Sink):
    """Buffers up to one part; a larger file becomes a multipart upload whose parts are uploaded in
    parallel (bounded by the bucket's pool) while the producer keeps writing. Each byte is copied once,
    into its part's buffer, which goes to boto3 as it is (slicing parts off a growing buffer copied every
    byte three times: a third of a save's time on the loopback server)."""

    def __init__(self, bucket: S3Bucket, key: str, exclusive: bool):
        self.b, self.key, self.exclusive = bucket, key, exclusive
        self.buf: Optional[bytearray] = bytearray()   # grows for the first part (most files are small)
        self.fill = 0
        self.upload_id: Optional[str] = None
        self.parts: List[Future] = []

    def write(self, view: memoryview) -> None:
        mv = memoryview(view).cast("B")
        while len(mv):
            size = part_size(len(self.parts) + 1)
            if self.buf is None:        # a later part of a large file: one allocation, filled in place
                self.buf, self.fill = bytearray(size), 0
            n = min(len(mv), size - self.fill)
            if self.upload_id is None:
                self.buf += mv[:n]
            else:
                self.buf[self.fill:self.fill + n] = mv[:n]
            self.fill += n
            mv = mv[n:]
            if self.fill == size:
                self._send_part(self.buf)
                self.buf, self.fill = None, 0

    def _send_part(self, data: bytearray) -> None:
        if self.upload_id is None:
            resp = self.b.call("create_multipart_upload", self.key, Key=self.key, ChecksumAlgorithm="CRC32C")
            self.upload_id = resp["UploadId"]
        number = len(self.parts) + 1
        # Back-pressure: at most `workers` parts in flight per file, so memory stays bounded.
        while sum(not f.done() for f in self.parts) >= self.b.workers:
            next(f for f in self.parts if not f.done()).result()
        self.parts.append(self.b._pool.submit(self._upload_part, number, data))

    def _upload_part(self, number: int, data: bytearray) -> dict:
        crc = _b64_crc(_crc32c.crc32c(data))
        resp = self.b.call("upload_part", self.key, Key=self.key, UploadId=self.upload_id, PartNumber=number,
                           Body=data, ChecksumAlgorithm="CRC32C", ChecksumCRC32C=crc)
        return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumCRC32C": crc}

    def finish(self, record: FileRecord, durable: bool) -> None:
        if self.upload_id is None:
            self.b.put(self.key, bytes(self.buf or b""), record.crc32c, self.exclusive)
            return
        if self.buf is not None and self.fill:
            del self.buf[self.fill:]    # the last part: truncated in place, not copied
            self._send_part(self.buf)
        self.buf, self.fill = None, 0
        parts = [f.result() for f in self.parts]
        kw = {"IfNoneMatch": "*"} if self.exclusive else {}
        self.b.call("complete_multipart_upload", self.key, Key=self.key, UploadId=self.upload_id,
                    MultipartUpload={"Parts": parts}, **kw)
        self.upload_id = None

    def abort(self) -> None:
        self.buf, self.fill = None, 0
        if self.upload_id is None:
            return
        for f in self.parts:
            f.cancel()
        try:
            # A short cap: after a failed save the server may be the thing that stopped answering.
            self.b._client_for(1.0)[0].abort_multipart_upload(Bucket=self.b.name, Key=self.key, UploadId=self.upload_id)
        except Exception:  # noqa: BLE001 - best effort; a lifecycle rule removes stale uploads
            pass
        self.upload_id = None


def _body_into(body, view: memoryview) -> None:
    """Read a response body of exactly ``len(view)`` bytes into ``view``; a shorter body (the connection
    dropped) raises a transient error, so the range is requested again."""
    got = 0
    while got < len(view):
        n = body.readinto(view[got:])
        if not n:
            raise ConnectionError(f"the response body ended after {got} of {len(view)} bytes")
        got += n


def _transient_errors() -> tuple:
    from botocore.exceptions import (ConnectionClosedError, ConnectTimeoutError, EndpointConnectionError,
                                     IncompleteReadError, ReadTimeoutError, ResponseStreamingError)
    from urllib3.exceptions import ProtocolError

    return (ConnectionClosedError, ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError,
            ResponseStreamingError, IncompleteReadError, ProtocolError, ConnectionError)


def make_client(endpoint_url: Optional[str], timeout_s: float, *, connect_s: float = CONNECT_TIMEOUT_S,
                read_s: float = READ_TIMEOUT_S):
    """A boto3 S3 client from the standard AWS configuration chain; our own retries (botocore's are off),
    botocore's own checksums only where required (we send and verify CRC32C ourselves). Over https the
    bodies are not SHA-256-signed: each upload's CRC32C header is signed and TLS carries the body, which is
    botocore's own choice for checksummed uploads (it misses it when the checksum comes as a value, as
    ours does, and would hash every byte: about 0.6 CPU-s per GB here). Plain-http endpoints (test
    servers) keep the signed payload."""
    import boto3
    from botocore.config import Config

    cfg = Config(retries={"total_max_attempts": 1}, connect_timeout=min(connect_s, timeout_s),
                 read_timeout=min(read_s, timeout_s), max_pool_connections=64,
                 request_checksum_calculation="when_required", response_checksum_validation="when_required")
    kw = {"endpoint_url": endpoint_url} if endpoint_url else {}
    if not os.environ.get("AWS_REGION") and not os.environ.get("AWS_DEFAULT_REGION"):
        kw["region_name"] = "us-east-1"
    session = boto3.session.Session()
    client = session.client("s3", config=cfg, **kw)
    if client.meta.endpoint_url.startswith("https://"):
        client = session.client("s3", config=cfg.merge(Config(s3={"payload_signing_enabled": False})), **kw)
    return client


def parse_s3_url(url: str) -> Tuple[str, str]:
    """(bucket, prefix) of ``s3://bucket/prefix``."""
    rest = url[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket: pass s3://BUCKET/PREFIX")
    return bucket, prefix.strip("/")

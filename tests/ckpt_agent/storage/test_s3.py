"""S3 specifics against a real MinIO: encryption, permanent errors, bounded memory."""

from __future__ import annotations

import hashlib
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ckpt_agent.storage import NotFoundError, PermanentStorageError, RetryableStorageError

pytestmark = pytest.mark.s3

MIB = 1024 * 1024


def data_of(n: int, seed: int = 1) -> bytes:
    block = hashlib.sha256(seed.to_bytes(4, "little")).digest() * 2048  # 64 KiB
    return (block * (n // len(block) + 1))[:n]


def head(store: Any, key: str) -> dict[str, Any]:
    return store.client.head_object(Bucket=store.bucket, Key=store._root_prefix + key)  # type: ignore[no-any-return]


@pytest.mark.parametrize("size", [1000, 12 * MIB], ids=["put", "multipart"])
def test_sse_s3(make_s3: Any, size: int) -> None:
    s = make_s3(sse="AES256")
    payload = data_of(size)
    s.write("enc", payload)
    s.commit("COMMIT", b"ok")
    assert head(s, "enc")["ServerSideEncryption"] == "AES256"
    assert head(s, "COMMIT")["ServerSideEncryption"] == "AES256"
    assert s.read("enc") == payload  # decrypted transparently
    assert s.read("enc", 10, 5) == payload[10:15]
    plain = make_s3()
    plain.write("clear", b"x")
    assert "ServerSideEncryption" not in head(plain, "clear")


@pytest.mark.parametrize("size", [1000, 12 * MIB], ids=["put", "multipart"])
def test_sse_kms_with_key_id(make_s3: Any, minio: Any, size: int) -> None:
    s = make_s3(sse="aws:kms", kms_key_id=minio.kms_key)
    payload = data_of(size, seed=2)
    s.write("enc", payload)
    h = head(s, "enc")
    assert h["ServerSideEncryption"] == "aws:kms"
    assert minio.kms_key in h.get("SSEKMSKeyId", "")
    with s.open_read("enc") as r:
        assert r.read() == payload


def test_sse_kms_unknown_key_is_permanent(make_s3: Any) -> None:
    s = make_s3(sse="aws:kms", kms_key_id="no-such-key")
    t0 = time.monotonic()
    with pytest.raises(PermanentStorageError) as ei:
        s.write("enc", b"secret")
    assert time.monotonic() - t0 < 5
    assert s.calls["PutObject"] == 1  # not retried
    assert "s3://ckpt-test/" in str(ei.value)
    assert not s.exists("enc")


def test_wrong_access_key_fails_fast_with_what_to_fix(make_s3: Any) -> None:
    s = make_s3(access_key_id="NOT-A-KEY", secret_access_key="whatever")
    t0 = time.monotonic()
    with pytest.raises(PermanentStorageError, match="InvalidAccessKeyId") as ei:
        s.write("k", b"v")
    assert "AWS_ACCESS_KEY_ID" in str(ei.value) and "CKPT_S3_ACCESS_KEY_ID" in str(ei.value)
    assert s.calls["PutObject"] == 1 and s.retries == 0
    with pytest.raises(PermanentStorageError, match="InvalidAccessKeyId"):
        s.write("big", data_of(12 * MIB))  # multipart: fails at CreateMultipartUpload
    # HEAD answers a bare 403: the backend asks a call with an error body
    with pytest.raises(PermanentStorageError, match="InvalidAccessKeyId"):
        s.stat("k")
    with pytest.raises(PermanentStorageError, match="InvalidAccessKeyId"):
        s.exists("k")
    with pytest.raises(PermanentStorageError, match="InvalidAccessKeyId"):
        list(s.list())
    assert time.monotonic() - t0 < 10
    assert s.retries == 0


def test_wrong_secret_key(make_s3: Any, minio: Any) -> None:
    s = make_s3(access_key_id=minio.access_key, secret_access_key="wrong-secret")
    with pytest.raises(PermanentStorageError, match="SignatureDoesNotMatch") as ei:
        s.commit("COMMIT", b"v")
    assert "secret access key does not match" in str(ei.value)
    assert s.retries == 0


def test_missing_bucket_is_permanent_everywhere(make_s3: Any) -> None:
    s = make_s3(bucket="no-such-bucket")
    for action in (
        lambda: s.write("k", b"v"),
        lambda: s.write("big", data_of(6 * MIB)),
        lambda: s.commit("COMMIT", b"v"),
        lambda: s.read("k"),
        lambda: s.stat("k"),
        lambda: s.exists("k"),  # not a silent False
        lambda: list(s.list("steps/")),
        lambda: s.delete("k"),
        s.check,
    ):
        with pytest.raises(PermanentStorageError, match="NoSuchBucket") as ei:
            action()
        assert "create it" in str(ei.value) and "no-such-bucket" in str(ei.value)
        assert ei.value.code == "NoSuchBucket"  # from HEAD (no code) too: the bucket check
    assert s.retries == 0


def test_not_found_in_existing_bucket(make_s3: Any) -> None:
    s = make_s3()
    s.check()
    with pytest.raises(NotFoundError):
        s.stat("nope")
    with pytest.raises(NotFoundError):
        s.read("nope", 5, 5)
    assert not s.exists("nope")


def test_delete_prefix_batches(make_s3: Any) -> None:
    s = make_s3()
    for i in range(30):
        s.write(f"old/{i:03d}", b"x")
    s.write("keep", b"y")
    assert s.delete_prefix("old/") == 30
    assert s.calls["DeleteObjects"] == 1
    assert [i.key for i in s.list()] == ["keep"]


def test_streaming_write_memory_is_bounded(make_s3: Any) -> None:
    """60 MiB through a writer with 5 MiB parts and 2 in flight: memory stays at a few parts."""
    s = make_s3(max_concurrency=2)
    chunk = memoryview(data_of(MIB, seed=3))
    digest = hashlib.sha256()
    tracemalloc.start()
    try:
        with s.open_write("stream/big") as f:
            for _ in range(60):
                f.write(chunk)
                digest.update(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert s.calls["UploadPart"] == 12
    assert peak < 6 * 5 * MIB, f"peak {peak / MIB:.1f} MiB"  # not 60 MiB (or twice that)
    got = hashlib.sha256()
    with s.open_read("stream/big") as r:
        while block := r.read(4 * MIB):
            got.update(block)
    assert got.digest() == digest.digest()


def _hammer(store: Any, n: int = 12) -> list[BaseException | None]:
    """n concurrent 6 MiB writes; returns each one's error (None: success)."""

    def one(i: int) -> BaseException | None:
        try:
            store.write(f"w/{i}", data_of(6 * MIB, seed=i))
        except Exception as e:
            return e
        return None

    with ThreadPoolExecutor(6) as pool:
        return list(pool.map(one, range(n)))


def test_server_throttling_is_retried_with_backoff(make_s3: Any, throttled_minio: Any) -> None:
    """Real throttling from MinIO (requests queued past its deadline get 503)."""
    eager = make_s3(endpoint=throttled_minio.endpoint, max_attempts=1)
    errors = [e for e in _hammer(eager) if e is not None]
    assert errors, "the server did not throttle; the test proves nothing"
    assert all(isinstance(e, RetryableStorageError) for e in errors), errors
    assert any("TooManyRequests" in str(e) or "SlowDown" in str(e) for e in errors), errors
    patient = make_s3(
        endpoint=throttled_minio.endpoint, max_attempts=12, backoff_base_s=0.2, backoff_max_s=1.5
    )
    assert _hammer(patient) == [None] * 12
    assert patient.retries > 0
    for i in range(12):
        assert patient.read(f"w/{i}", 0, 64) == data_of(64, seed=i)

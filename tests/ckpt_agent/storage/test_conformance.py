"""Backend conformance: the same behaviour from the filesystem and from real MinIO."""

from __future__ import annotations

import hashlib
import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ckpt_agent.storage import (
    NotFoundError,
    ObjectInfo,
    PermanentStorageError,
    Storage,
)
from ckpt_agent.storage.fs import LocalStorage

MIB = 1024 * 1024


def blob(n: int, seed: int = 0) -> bytes:
    """Deterministic, incompressible-enough bytes."""
    out = bytearray()
    block = hashlib.sha256(seed.to_bytes(8, "little")).digest()
    while len(out) < n:
        block = hashlib.sha256(block).digest()
        out += block * 64
    return bytes(out[:n])


def keys_of(items: Any) -> list[str]:
    return [i.key for i in items]


def leftovers(store: Storage) -> list[str]:
    """Anything physically left behind by in-flight or failed writes."""
    if isinstance(store, LocalStorage):
        if not store.root.exists():
            return []
        return sorted(
            os.path.relpath(os.path.join(d, f), store.root)
            for d, _, files in os.walk(store.root)
            for f in files
        )
    client = store.client  # type: ignore[attr-defined]
    prefix = store._root_prefix  # type: ignore[attr-defined]
    ups = client.list_multipart_uploads(Bucket=store.bucket, Prefix=prefix)  # type: ignore[attr-defined]
    objs = client.list_objects_v2(Bucket=store.bucket, Prefix=prefix)  # type: ignore[attr-defined]
    return sorted(
        [f"upload:{u['Key']}" for u in ups.get("Uploads", [])]
        + [o["Key"][len(prefix) :] for o in objs.get("Contents", [])]
    )


# --- write / read ---------------------------------------------------------------------


def test_write_read_roundtrip_and_overwrite(storage: Storage) -> None:
    storage.write("a/b/c.bin", b"hello world")
    assert storage.read("a/b/c.bin") == b"hello world"
    storage.write("a/b/c.bin", memoryview(b"second"))
    assert storage.read("a/b/c.bin") == b"second"
    storage.write("empty", b"")
    assert storage.read("empty") == b""
    assert storage.stat("empty").size == 0


def test_ranged_reads(storage: Storage) -> None:
    data = blob(100_000)
    storage.write("r", data)
    assert storage.read("r", 0, 10) == data[:10]
    assert storage.read("r", 500) == data[500:]
    assert storage.read("r", 99_990, 100) == data[99_990:]  # short at the end
    assert storage.read("r", 100_000) == b""  # at the end
    assert storage.read("r", 200_000, 5) == b""  # beyond the end
    assert storage.read("r", 7, 0) == b""
    with pytest.raises(ValueError):
        storage.read("r", -1)


def test_read_into_fills_exactly_and_shows_each_block(storage: Storage) -> None:
    data = blob(100_000, seed=3)
    storage.write("r", data)
    out = memoryview(bytearray(len(data)))
    seen: list[bytes] = []
    assert storage.read_into("r", out, lambda piece: seen.append(bytes(piece)), 4096) == len(data)
    assert bytes(out) == data and b"".join(seen) == data
    assert all(len(p) == 4096 for p in seen[:-1])
    small = memoryview(bytearray(10))
    assert storage.read_into("r", small) == len(data)  # another size: reported, not read
    assert bytes(small) == bytes(10)
    storage.write("empty", b"")
    assert storage.read_into("empty", memoryview(bytearray(0))) == 0
    with pytest.raises(NotFoundError):
        storage.read_into("missing", out)


def test_streaming_write_and_seekable_read(storage: Storage) -> None:
    data = blob(3 * MIB + 123)
    with storage.open_write("stream/x") as f:
        for i in range(0, len(data), 100_001):
            assert f.write(data[i : i + 100_001]) == len(data[i : i + 100_001])
    with storage.open_read("stream/x") as r:
        assert r.read(10) == data[:10]
        r.seek(2 * MIB)
        assert r.read(5) == data[2 * MIB : 2 * MIB + 5]
        r.seek(-3, io.SEEK_END)
        assert r.read() == data[-3:]
        r.seek(0)
        assert hashlib.sha256(r.read()).digest() == hashlib.sha256(data).digest()


def test_stat_exists_and_missing(storage: Storage) -> None:
    storage.write("s/k", b"12345")
    info = storage.stat("s/k")
    assert (info.key, info.size) == ("s/k", 5)
    assert info.mtime is not None and info.mtime > 0
    assert storage.exists("s/k")
    assert not storage.exists("s/missing")
    assert not storage.exists("s")  # a "directory" is not an object
    with pytest.raises(NotFoundError):
        storage.stat("s/missing")
    with pytest.raises(NotFoundError):
        storage.read("s/missing")
    with pytest.raises(FileNotFoundError):  # NotFoundError is also a FileNotFoundError
        storage.open_read("s/missing")


@pytest.mark.parametrize("bad", ["", "/abs", "a//b", "a/../b", "./a", "a/", "a\\b", ".ckpt-tmp.x"])
def test_invalid_keys_are_permanent_errors(storage: Storage, bad: str) -> None:
    with pytest.raises(PermanentStorageError, match="invalid key"):
        storage.write(bad, b"x")
    assert leftovers(storage) == []


# --- listing --------------------------------------------------------------------------

LIST_KEYS = [  # a filesystem can't hold a key that is also a prefix ("a" and "a/b")
    "a-c",
    "a/b.txt",
    "a/b/c",
    "a/b/d/e",
    "a/bz",
    "a0",
    "b/x",
    "é/ü",  # non-ASCII sorts by code point == UTF-8 byte order
]


def test_list_is_in_key_order_with_prefixes(storage: Storage) -> None:
    for k in reversed(LIST_KEYS):
        storage.write(k, k.encode())
    assert keys_of(storage.list()) == sorted(LIST_KEYS, key=lambda k: k.encode())
    assert keys_of(storage.list("a/")) == ["a/b.txt", "a/b/c", "a/b/d/e", "a/bz"]
    assert keys_of(storage.list("a/b")) == ["a/b.txt", "a/b/c", "a/b/d/e", "a/bz"]
    assert keys_of(storage.list("a/b/")) == ["a/b/c", "a/b/d/e"]
    assert keys_of(storage.list("a/b/d")) == ["a/b/d/e"]
    assert keys_of(storage.list("zzz")) == []
    assert keys_of(storage.list("nope/")) == []
    sizes = {i.key: i.size for i in storage.list()}
    assert sizes["a/b/d/e"] == len(b"a/b/d/e")


def test_list_with_delimiter(storage: Storage) -> None:
    for k in LIST_KEYS:
        storage.write(k, b"1")
    top = list(storage.list(delimiter="/"))
    assert keys_of(top) == ["a-c", "a/", "a0", "b/", "é/"]
    assert [i.is_prefix for i in top] == [False, True, False, True, True]
    assert all(i.size == 0 for i in top if i.is_prefix)
    assert keys_of(storage.list("a/", delimiter="/")) == ["a/b.txt", "a/b/", "a/bz"]
    assert keys_of(storage.list("a/b", delimiter="/")) == ["a/b.txt", "a/b/", "a/bz"]
    assert keys_of(storage.list("a/b/", delimiter="/")) == ["a/b/c", "a/b/d/"]
    assert keys_of(storage.list("a", delimiter="/")) == ["a-c", "a/", "a0"]


def test_list_never_shows_in_flight_or_failed_writes(storage: Storage) -> None:
    storage.write("steps/1/COMMIT", b"ok")
    w = storage.open_write("steps/2/blob")
    w.write(blob(1000))
    assert keys_of(storage.list()) == ["steps/1/COMMIT"]
    assert keys_of(storage.list("steps/", delimiter="/")) == ["steps/1/"]
    assert not storage.exists("steps/2/blob")
    w.close()
    assert keys_of(storage.list()) == ["steps/1/COMMIT", "steps/2/blob"]


def test_list_pagination_is_lazy_and_complete(storage: Storage, request: Any) -> None:
    n = 1100
    keys = [f"many/{i:05d}" for i in range(n)]
    if storage.url.startswith("s3://"):
        storage = request.getfixturevalue("make_s3")(list_page_size=100)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: storage.write(k, b"x"), keys))
    it = storage.list("many/")
    first = next(it)
    assert first.key == "many/00000"
    if storage.url.startswith("s3://"):
        assert storage.calls["ListObjectsV2"] == 1  # type: ignore[attr-defined]
    rest = [i.key for i in it]
    assert [first.key, *rest] == keys
    if storage.url.startswith("s3://"):
        # 11 full pages; a server may also answer a last, empty page (MinIO does)
        assert storage.calls["ListObjectsV2"] in (11, 12)  # type: ignore[attr-defined]
    # delimiter listing over many prefixes, also paginated
    assert keys_of(storage.list(delimiter="/")) == ["many/"]


# --- delete ---------------------------------------------------------------------------


def test_delete_and_delete_prefix(storage: Storage) -> None:
    for k in ["d/1", "d/2/x", "d/2/y", "e"]:
        storage.write(k, b"1")
    storage.delete("d/1")
    storage.delete("d/1")  # missing: not an error
    storage.delete("never/was")
    assert keys_of(storage.list()) == ["d/2/x", "d/2/y", "e"]
    assert storage.delete_prefix("d/") == 2
    assert keys_of(storage.list()) == ["e"]
    assert keys_of(storage.list(delimiter="/")) == ["e"]  # no empty "directories" left
    assert storage.delete_prefix("d/") == 0


def test_delete_many_deletes_in_batches_and_ignores_missing(storage: Storage) -> None:
    keys = [f"m/{i:04d}" for i in range(1005)]  # over one S3 DeleteObjects request
    for k in keys:
        storage.write(k, b"x")
    storage.write("m-keep", b"k")
    assert storage.delete_many(iter([*keys, "never/was"])) == 1006
    assert keys_of(storage.list()) == ["m-keep"]
    assert storage.delete_many([]) == 0


def test_create_exclusive_creates_once_and_never_replaces(storage: Storage) -> None:
    assert storage.atomic_create
    assert storage.create_exclusive("x/claim", b"first")
    assert getattr(storage, "conditional_put", True) is True  # MinIO honours If-None-Match
    assert storage.create_exclusive("x/claim", b"first")  # our own retried request
    assert not storage.create_exclusive("x/claim", b"second")
    assert storage.read("x/claim") == b"first"
    storage.commit("x/other", b"old")
    assert not storage.create_exclusive("x/other", b"new")
    assert storage.read("x/other") == b"old"
    assert keys_of(storage.list()) == ["x/claim", "x/other"]
    assert leftovers(storage) == ["x/claim", "x/other"]  # no temporary left behind
    storage.delete("x/claim")
    assert storage.create_exclusive("x/claim", b"again")


def test_create_exclusive_race_has_exactly_one_winner(storage: Storage) -> None:
    for round_ in range(3):
        key = f"race/{round_:04d}"
        with ThreadPoolExecutor(8) as pool:
            won = list(
                pool.map(lambda i, k=key: storage.create_exclusive(k, f"w{i}".encode()), range(8))
            )
        assert sum(won) == 1, won
        assert storage.read(key) == f"w{won.index(True)}".encode()


# --- commit protocol --------------------------------------------------------------------


def test_commit_publishes_atomically_and_records_latency(storage: Storage) -> None:
    seen: list[float] = []
    storage.on_write_latency = seen.append
    storage.write("steps/full_1/rank_0.json", b'{"blobs": []}')
    assert not storage.exists("steps/full_1/COMMIT")
    storage.commit("steps/full_1/COMMIT", b"committed")
    assert storage.read("steps/full_1/COMMIT") == b"committed"
    assert len(seen) == 2 and all(s > 0 for s in seen)
    assert storage.last_write_latency_s == seen[-1]
    assert storage.last_write_bytes == len(b"committed")


def test_failed_write_publishes_nothing(storage: Storage) -> None:
    storage.write("k", b"previous")
    with pytest.raises(RuntimeError):
        with storage.open_write("k") as f:
            f.write(b"partial new content")
            raise RuntimeError("serializer crashed")
    assert storage.read("k") == b"previous"
    with pytest.raises(ZeroDivisionError):
        with storage.open_write("new/key") as f:
            f.write(blob(100))
            _ = 1 / 0
    assert not storage.exists("new/key")
    w = storage.open_write("aborted")
    w.write(b"x")
    w.abort()
    assert w.closed
    with pytest.raises(ValueError):
        w.write(b"y")
    assert leftovers(storage) == ["k"]
    assert keys_of(storage.list()) == ["k"]


def test_dropped_writer_publishes_nothing(storage: Storage) -> None:
    w = storage.open_write("dropped")
    w.write(b"data")
    del w  # garbage collected without close(): IOBase would publish, we must not
    import gc

    gc.collect()
    assert not storage.exists("dropped")
    assert leftovers(storage) == []


def test_large_multipart_write_in_parallel(storage: Storage, request: Any) -> None:
    """23 MiB in 1 MiB chunks: one PUT on fs; 5 parts of 5 MiB, 3 in flight, on S3."""
    data = blob(23 * MIB, seed=7)
    in_flight = max_in_flight = 0
    lock = threading.Lock()
    if storage.url.startswith("s3://"):
        events = storage.client.meta.events  # type: ignore[attr-defined]

        def before(**_: Any) -> None:
            nonlocal in_flight, max_in_flight
            with lock:
                in_flight += 1
                max_in_flight = max(max_in_flight, in_flight)

        def after(**_: Any) -> None:
            nonlocal in_flight
            with lock:
                in_flight -= 1

        events.register("before-call.s3.UploadPart", before)
        events.register("after-call.s3.UploadPart", after)
    with storage.open_write("big/blob") as f:
        for i in range(0, len(data), MIB):
            f.write(data[i : i + MIB])
    assert storage.stat("big/blob").size == len(data)
    assert hashlib.sha256(storage.read("big/blob")).digest() == hashlib.sha256(data).digest()
    assert storage.read("big/blob", 5 * MIB - 3, 6) == data[5 * MIB - 3 : 5 * MIB + 3]
    assert storage.last_write_bytes == len(data)
    if storage.url.startswith("s3://"):
        calls = storage.calls  # type: ignore[attr-defined]
        assert calls["CreateMultipartUpload"] == 1
        assert calls["UploadPart"] == 5
        assert calls["CompleteMultipartUpload"] == 1
        assert calls["PutObject"] == 0
        assert 2 <= max_in_flight <= 3  # parallel, but bounded by max_concurrency
        head = storage.client.head_object(  # type: ignore[attr-defined]
            Bucket=storage.bucket,  # type: ignore[attr-defined]
            Key=storage._root_prefix + "big/blob",  # type: ignore[attr-defined]
        )
        assert head["ETag"].strip('"').endswith("-5")
    assert leftovers(storage) == ["big/blob"]


def test_failed_multipart_write_leaves_nothing(storage: Storage) -> None:
    storage.write("big", b"previous")
    with pytest.raises(RuntimeError):
        with storage.open_write("big") as f:
            f.write(blob(12 * MIB))  # two parts already shipped on S3
            raise RuntimeError("rank died mid-save")
    assert storage.read("big") == b"previous"
    assert leftovers(storage) == ["big"]  # no temp file, no pending multipart upload


def test_concurrent_writers_of_one_key(storage: Storage) -> None:
    payloads = [bytes([i]) * 50_000 for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: storage.write("same", p), payloads))
    assert storage.read("same") in payloads
    assert leftovers(storage) == ["same"]


def test_object_info_is_a_value(storage: Storage) -> None:
    storage.write("v", b"abc")
    [info] = list(storage.list())
    assert info == ObjectInfo("v", 3, info.mtime)

"""The S3 backend's request sequences against a stubbed client (no server needed).

The MinIO-backed tests (``test_s3.py``, marked ``s3``) cover behaviour against a
real server; these pin the requests the backend's modules (``backend``,
``transfer``) send for a small PUT, a multipart upload, a listing and a read.
"""

from __future__ import annotations

import datetime
import io
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse
from botocore.response import StreamingBody
from botocore.stub import ANY, Stubber

from ckpt_agent.storage import (
    NotFoundError,
    PermanentStorageError,
    RetryableStorageError,
    StorageOptions,
)
from ckpt_agent.storage.s3 import S3Storage

PART = 5 * 1024 * 1024


@pytest.fixture
def stubbed() -> Iterator[tuple[S3Storage, Stubber]]:
    # One part upload at a time: the Stubber answers requests in the order they were added,
    # and two parts uploading in parallel may arrive in either order (a flake under load).
    # The parallel uploads are covered against a real server (test_s3.py).
    s = S3Storage(
        "b", "pre", StorageOptions(region="us-east-1", part_size_bytes=PART, max_concurrency=1)
    )
    stub = Stubber(s.client)
    stub.activate()
    try:
        yield s, stub
        stub.assert_no_pending_responses()
    finally:
        stub.deactivate()
        s.close()


def _body(data: bytes) -> Any:
    return StreamingBody(io.BytesIO(data), len(data))


def test_small_write_is_one_put_and_reads_back(stubbed: tuple[S3Storage, Stubber]) -> None:
    s, stub = stubbed
    stub.add_response("put_object", {"ETag": '"x"'}, {"Bucket": "b", "Key": "pre/k", "Body": b"hi"})
    stub.add_response("get_object", {"Body": _body(b"hi")}, {"Bucket": "b", "Key": "pre/k"})
    s.write("k", b"hi")
    with s.read_view("k") as view:  # the interface's default: a copy
        assert bytes(view) == b"hi"
    assert s.calls["PutObject"] == 1 and s.calls["GetObject"] == 1


class _AnyOrderS3:
    """Answers a client's S3 calls by operation, in whatever order they come.

    botocore's ``Stubber`` answers from one queue in order, and the writer uploads parts
    concurrently (under load part 2 may arrive before part 1), so a test of a multipart
    upload checks the set of parts it got, not their order. botocore still validates every
    call's parameters against the S3 model before they reach this hook; nothing is sent.
    """

    def __init__(self, client: Any, answers: dict[str, Callable[[dict[str, Any]], Any]]) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self._answers = answers
        self._lock = threading.Lock()
        client.meta.events.register("before-parameter-build.s3", self._record)
        client.meta.events.register("before-call.s3", self._answer)

    def _record(self, params: dict[str, Any], model: Any, context: Any, **_: Any) -> None:
        context["test_params"] = seen = dict(params)
        if isinstance(seen.get("Body"), io.BytesIO):  # botocore made the bytes a file
            seen["Body"] = seen["Body"].getvalue()
        with self._lock:
            self.calls.append((model.name, seen))

    def _answer(self, model: Any, context: Any, **_: Any) -> tuple[AWSResponse, Any]:
        answer = self._answers.get(model.name)
        if answer is None:  # never let an unexpected call reach the network
            raise AssertionError(f"unexpected S3 call {model.name}")
        return AWSResponse(None, 200, {}, None), answer(context["test_params"])

    def of(self, operation: str) -> list[dict[str, Any]]:
        return [params for name, params in self.calls if name == operation]


def test_large_write_is_a_multipart_upload() -> None:
    s = S3Storage("b", "pre", StorageOptions(region="us-east-1", part_size_bytes=PART))
    where = {"Bucket": "b", "Key": "pre/big"}
    second_done = threading.Event()

    def upload_part(p: dict[str, Any]) -> dict[str, str]:
        # the order a loaded machine gave: part 2 answered before part 1
        if p["PartNumber"] == 1:
            second_done.wait(timeout=10)
        else:
            second_done.set()
        return {"ETag": f'"p{p["PartNumber"]}"'}

    s3 = _AnyOrderS3(
        s.client,
        {
            "CreateMultipartUpload": lambda _p: {"UploadId": "U"},
            "UploadPart": upload_part,
            "CompleteMultipartUpload": lambda _p: {"ETag": '"e-2"'},
        },
    )
    try:
        with s.open_write("big") as f:
            f.write(b"x" * (PART + 1024))
    finally:
        s.close()
    names = [name for name, _ in s3.calls]
    assert names[0] == "CreateMultipartUpload" and names[-1] == "CompleteMultipartUpload"
    assert sorted(names[1:-1]) == ["UploadPart", "UploadPart"]
    assert s3.of("CreateMultipartUpload") == [{**where, "ChecksumAlgorithm": "CRC32"}]
    # every part once, whatever order the pool sent them in: part 1 full, part 2 the rest
    parts = {p["PartNumber"]: p for p in s3.of("UploadPart")}
    assert {n: len(p["Body"]) for n, p in parts.items()} == {1: PART, 2: 1024}
    assert all(
        {k: v for k, v in p.items() if k != "Body"} == {**where, "UploadId": "U", "PartNumber": n}
        for n, p in parts.items()
    )
    # Complete lists the parts in ascending order with each part's own ETag
    assert s3.of("CompleteMultipartUpload") == [
        {
            **where,
            "UploadId": "U",
            "MultipartUpload": {
                "Parts": [{"PartNumber": 1, "ETag": '"p1"'}, {"PartNumber": 2, "ETag": '"p2"'}]
            },
        }
    ]
    assert s.calls["UploadPart"] == 2


def test_listing_strips_the_prefix_and_skips_markers(stubbed: tuple[S3Storage, Stubber]) -> None:
    s, stub = stubbed
    now = datetime.datetime.now(datetime.UTC)
    stub.add_response(
        "list_objects_v2",
        {
            "Contents": [
                {"Key": "pre/run/a", "Size": 3, "LastModified": now},
                {"Key": "pre/run/dir/", "Size": 0, "LastModified": now},
            ],
            "IsTruncated": False,
        },
        {"Bucket": "b", "Prefix": "pre/run/", "MaxKeys": ANY},
    )
    assert [(i.key, i.size) for i in s.list("run/")] == [("run/a", 3)]


class _Counted(io.BytesIO):
    """A response body that counts what was read from it."""

    taken = 0

    def read(self, size: int | None = -1, /) -> bytes:
        data = super().read(size)
        self.taken += len(data)
        return data


def test_a_ranged_read_never_takes_more_than_it_asked(stubbed: tuple[S3Storage, Stubber]) -> None:
    """A server that ignores Range and sends the whole object: the body is read at most
    one byte past the range; from the start the range is cut out, elsewhere it is refused."""
    s, stub = stubbed
    whole = bytes(range(100))
    sent = _Counted(whole)
    stub.add_response(
        "get_object",
        {"Body": StreamingBody(sent, len(whole))},
        {"Bucket": "b", "Key": "pre/k", "Range": "bytes=0-3"},
    )
    assert s.read("k", 0, 4) == whole[:4]
    assert sent.taken == 5  # not the whole body
    stub.add_response(
        "get_object",
        {"Body": _body(whole)},
        {"Bucket": "b", "Key": "pre/k", "Range": "bytes=10-13"},
    )
    with pytest.raises(PermanentStorageError, match="ignored the Range header"):
        s.read("k", 10, 4)


# --- the backend decides on S3's error code, never on the message text ---------------------


def _stubbed(**options: Any) -> tuple[S3Storage, Stubber]:
    opts = StorageOptions(region="us-east-1", part_size_bytes=PART, **options)
    s = S3Storage("b", "pre", opts)
    stub = Stubber(s.client)
    stub.activate()
    return s, stub


def test_an_error_keeps_its_code_through_the_retries() -> None:
    s, stub = _stubbed(max_attempts=2, backoff_base_s=0.0)
    for _ in range(2):
        stub.add_client_error("get_object", "SlowDown", "slow down", 503)
    with pytest.raises(RetryableStorageError, match="gave up after 2") as ei:
        s.read("k")
    assert ei.value.code == "SlowDown"
    stub.add_client_error("get_object", "NoSuchKey", "gone", 404)
    with pytest.raises(NotFoundError) as nf:
        s.read("k")
    assert nf.value.code == "NoSuchKey"
    s.close()


def test_a_read_past_the_end_is_empty_by_code_not_by_message() -> None:
    s, stub = _stubbed()
    stub.add_client_error("get_object", "InvalidRange", "not satisfiable", 416)
    assert s.read("k", 10, 5) == b""
    # a key that merely names the code is no licence to swallow a real refusal
    stub.add_client_error("get_object", "AccessDenied", "no", 403)
    with pytest.raises(PermanentStorageError, match="AccessDenied"):
        s.read("InvalidRange", 10, 5)
    stub.assert_no_pending_responses()
    s.close()


def test_a_failed_complete_is_not_excused_by_a_key_that_names_no_such_upload() -> None:
    s, stub = _stubbed()
    where = {"Bucket": "b", "Key": "pre/NoSuchUpload"}
    stub.add_response("create_multipart_upload", {"UploadId": "U"}, None)
    for n in (1, 2):
        stub.add_response("upload_part", {"ETag": f'"p{n}"'}, None)
    stub.add_client_error("complete_multipart_upload", "AccessDenied", "no", 403)
    done = {"ETag": '"e-2"', "ContentLength": PART + 1, "LastModified": datetime.datetime.now()}
    stub.add_response("head_object", done, where)
    with pytest.raises(PermanentStorageError, match="AccessDenied"):
        with s.open_write("NoSuchUpload") as f:
            f.write(b"x" * (PART + 1))
    assert s.calls["HeadObject"] == 0  # the error's code is not NoSuchUpload: no excuse sought
    s.close()


def test_a_refused_read_is_not_a_replaced_object_because_of_its_key() -> None:
    s, stub = _stubbed(max_attempts=1)
    where = {"Bucket": "b", "Key": "pre/PreconditionFailed"}
    head = {"ETag": '"e"', "ContentLength": 4, "LastModified": datetime.datetime.now(datetime.UTC)}
    stub.add_response("head_object", head, where)
    stub.add_client_error("get_object", "AccessDenied", "no", 403)
    with s.open_read("PreconditionFailed") as r, pytest.raises(PermanentStorageError):
        r.read()
    stub.add_response("head_object", head, {**where, "Key": "pre/k"})
    stub.add_client_error("get_object", "PreconditionFailed", "changed", 412)
    with s.open_read("k") as r, pytest.raises(RetryableStorageError, match="replaced"):
        r.read()
    stub.assert_no_pending_responses()
    s.close()


def test_delete_many_is_one_request_per_thousand_keys_and_names_failed_keys(
    stubbed: tuple[S3Storage, Stubber],
) -> None:
    s, stub = stubbed
    keys = [f"k{i:04d}" for i in range(1001)]
    first = {"Objects": [{"Key": f"pre/{k}"} for k in keys[:1000]], "Quiet": True}
    stub.add_response(
        "delete_objects",
        {"Errors": [{"Key": "pre/k0007", "Code": "AccessDenied", "Message": "no"}]},
        {"Bucket": "b", "Delete": first},
    )
    stub.add_response(
        "delete_objects",
        {},
        {"Bucket": "b", "Delete": {"Objects": [{"Key": "pre/k1000"}], "Quiet": True}},
    )
    with pytest.raises(
        PermanentStorageError, match=r"1 of 1001 key\(s\) not deleted: k0007: .*AccessDenied"
    ):
        s.delete_many(keys)  # the second batch is still sent


def test_create_exclusive_is_a_conditional_put_checked_once_per_instance() -> None:
    s, stub = _stubbed()
    put = {"Bucket": "b", "Key": "pre/w/1", "Body": b"me", "IfNoneMatch": "*"}
    stub.add_response("put_object", {"ETag": '"x"'}, put)
    stub.add_client_error("put_object", "PreconditionFailed", "taken", 412, expected_params=put)
    assert s.create_exclusive("w/1", b"me")
    assert s.conditional_put is True  # the server refused the second identical PUT
    # a taken key: read back, someone else's bytes -> False (never overwritten)
    put2 = {"Bucket": "b", "Key": "pre/w/2", "Body": b"me", "IfNoneMatch": "*"}
    stub.add_client_error("put_object", "PreconditionFailed", "taken", 412, expected_params=put2)
    stub.add_response(
        "get_object",
        {"Body": _body(b"other")},
        {"Bucket": "b", "Key": "pre/w/2", "Range": "bytes=0-2"},
    )
    assert not s.create_exclusive("w/2", b"me")
    stub.assert_no_pending_responses()
    s.close()


def test_create_exclusive_falls_back_when_the_server_ignores_if_none_match() -> None:
    s, stub = _stubbed()
    put = {"Bucket": "b", "Key": "pre/w/1", "Body": b"me", "IfNoneMatch": "*"}
    stub.add_response("put_object", {"ETag": '"x"'}, put)
    stub.add_response("put_object", {"ETag": '"x"'}, put)  # accepted again: header ignored
    assert s.create_exclusive("w/1", b"me")
    assert s.conditional_put is False
    # the fallback: HEAD (taken) -> read back -> someone else's -> False
    stub.add_response(
        "head_object",
        {"ContentLength": 5, "LastModified": datetime.datetime.now(datetime.UTC), "ETag": '"y"'},
        {"Bucket": "b", "Key": "pre/w/2"},
    )
    stub.add_response(
        "get_object",
        {"Body": _body(b"other")},
        {"Bucket": "b", "Key": "pre/w/2", "Range": "bytes=0-2"},
    )
    assert not s.create_exclusive("w/2", b"me")
    stub.assert_no_pending_responses()
    s.close()

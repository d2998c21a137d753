"""The S3 backend's request sequences against a stubbed client (no server needed).

The MinIO-backed tests (``test_s3.py``, marked ``s3``) cover behaviour against a
real server; these pin the requests the backend's modules (``backend``,
``transfer``) send for a small PUT, a multipart upload, a listing and a read.
"""

from __future__ import annotations

import datetime
import io
from collections.abc import Iterator
from typing import Any

import pytest
from botocore.response import StreamingBody
from botocore.stub import ANY, Stubber

from ckpt_agent.storage import StorageOptions
from ckpt_agent.storage.s3 import S3Storage

PART = 5 * 1024 * 1024


@pytest.fixture
def stubbed() -> Iterator[tuple[S3Storage, Stubber]]:
    s = S3Storage("b", "pre", StorageOptions(region="us-east-1", part_size_bytes=PART))
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


def test_large_write_is_a_multipart_upload(stubbed: tuple[S3Storage, Stubber]) -> None:
    s, stub = stubbed
    where = {"Bucket": "b", "Key": "pre/big"}
    stub.add_response(
        "create_multipart_upload", {"UploadId": "U"}, {**where, "ChecksumAlgorithm": "CRC32"}
    )
    for n in (1, 2):
        stub.add_response(
            "upload_part",
            {"ETag": f'"p{n}"'},
            {**where, "UploadId": "U", "PartNumber": n, "Body": ANY},
        )
    stub.add_response(
        "complete_multipart_upload",
        {"ETag": '"e-2"'},
        {
            **where,
            "UploadId": "U",
            "MultipartUpload": {
                "Parts": [{"PartNumber": 1, "ETag": '"p1"'}, {"PartNumber": 2, "ETag": '"p2"'}]
            },
        },
    )
    with s.open_write("big") as f:
        f.write(b"x" * (PART + 1024))
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

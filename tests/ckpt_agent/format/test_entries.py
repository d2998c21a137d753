"""A rank manifest's entries (format.entries): round trips, and what a hostile entry is refused for."""

from __future__ import annotations

import pytest

from ckpt_agent.errors import CheckpointFormatError
from ckpt_agent.format.codec import CodecSpec
from ckpt_agent.format.entries import BlobEntry, TensorEntry
from ckpt_agent.format.layout import sha256_hex

RAW = sha256_hex(b"raw")
STORED = sha256_hex(b"stored")


def test_blob_entry_round_trips() -> None:
    blob = BlobEntry(STORED, 6, RAW, 3, CodecSpec(level=3, shuffle=4), raw_blake3=RAW)
    assert BlobEntry.from_json(STORED, blob.to_json(), "b") == blob
    plain = BlobEntry(RAW, 3, RAW, 3, CodecSpec(codec="none"))
    assert "raw_blake3" not in plain.to_json()
    assert BlobEntry.from_json(RAW, plain.to_json(), "b") == plain


def test_an_uncompressed_blob_must_be_its_raw_bytes() -> None:
    lying = BlobEntry(STORED, 3, RAW, 3, CodecSpec(codec="none")).to_json()
    with pytest.raises(CheckpointFormatError, match="uncompressed blob"):
        BlobEntry.from_json(STORED, lying, "b")


def test_tensor_entry_round_trips_chunked_and_inline() -> None:
    chunked = TensorEntry("float32", (2, 3), 24, chunks=(RAW, STORED))
    assert TensorEntry.from_json(chunked.to_json(), "t") == chunked
    data = bytes(8)
    inline = TensorEntry("int64", (1,), 8, inline=data, inline_sha256=sha256_hex(data))
    assert TensorEntry.from_json(inline.to_json(), "t") == inline


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"dtype": "complex1024"}, "unknown dtype"),
        ({"nbytes": 23}, "does not match shape"),
        ({"byte_order": "middle"}, "byte_order"),
        ({"shape": [1] * 65}, "dimensions"),
    ],
)
def test_a_hostile_tensor_entry_is_refused(change: dict[str, object], match: str) -> None:
    d = {**TensorEntry("float32", (2, 3), 24, chunks=(RAW,)).to_json(), **change}
    with pytest.raises(CheckpointFormatError, match=match):
        TensorEntry.from_json(d, "t")

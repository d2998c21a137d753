"""The validator's verdict document (format.verdict): round trip and refusals.

That a verdict sets a listed checkpoint's status only for the COMMIT it judged is
tested with the listing (``test_manifest.py``).
"""

from __future__ import annotations

import pytest

from ckpt_agent.errors import CheckpointFormatError
from ckpt_agent.format.layout import dumps, loads, sha256_hex
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.records import CheckpointStatus


def test_verdict_round_trips() -> None:
    v = ValidationVerdict(
        "pulse-00000010",
        sha256_hex(b"commit"),
        CheckpointStatus.CORRUPTED,
        reason="blob ab12 hash mismatch",
        validated_at=12.5,
        checks=("hashes", "load"),
        duration_s=0.25,
    )
    assert ValidationVerdict.from_bytes(v.to_bytes()) == v


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"format": "ckpt-commit"}, "not a validation record"),
        ({"status": "fine"}, "unknown status"),
    ],
)
def test_a_hostile_verdict_is_refused(change: dict[str, object], match: str) -> None:
    good = ValidationVerdict("pulse-00000010", sha256_hex(b"c"), CheckpointStatus.VALID)
    d = loads(good.to_bytes(), "v", 1 << 20)
    assert isinstance(d, dict)
    with pytest.raises(CheckpointFormatError, match=match):
        ValidationVerdict.from_bytes(dumps({**d, **change}))

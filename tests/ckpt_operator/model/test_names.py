"""Derived object names (model.names): deterministic, within 253 characters, distinct."""

from __future__ import annotations

import hashlib

import pytest

from ckpt_operator.model.names import MAX_OBJECT_NAME, derived_name


def test_a_short_name_is_the_prefix_and_the_name() -> None:
    assert derived_name("ckpt-", "policy-a") == "ckpt-policy-a"
    assert derived_name("ckpt-", "x" * (MAX_OBJECT_NAME - 5)) == "ckpt-" + "x" * 248


@pytest.mark.parametrize("prefix", ["ckpt-", "ckpt-replica-"])
def test_a_long_name_keeps_its_start_and_ends_in_its_digest(prefix: str) -> None:
    long_a, long_b = "a" * 300, "a" * 299 + "b"  # the same first 231+ characters
    got_a, got_b = derived_name(prefix, long_a), derived_name(prefix, long_b)
    assert len(got_a) == len(got_b) == MAX_OBJECT_NAME
    assert got_a != got_b and got_a == derived_name(prefix, long_a)
    assert got_a.startswith(prefix + "a" * 200)
    assert got_a.endswith("-" + hashlib.sha256(long_a.encode()).hexdigest()[:8])

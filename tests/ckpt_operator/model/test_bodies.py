"""Typed views over Kubernetes objects: every missing level reads as empty, never raises."""

from __future__ import annotations

from typing import Any

import pytest

from ckpt_operator.model.bodies import Body, Meta, continue_token, meta_of

POD: dict[str, Any] = {
    "metadata": {
        "name": "p",
        "namespace": "ns",
        "uid": "u-1",
        "resourceVersion": "42",
        "generation": 3,
        "creationTimestamp": "2026-01-01T00:00:00Z",
        "labels": {"a": "1"},
        "annotations": {"b": "2"},
        "ownerReferences": [{"kind": "PyTorchJob", "name": "j"}],
    },
    "spec": {"containers": []},
    "status": {"phase": "Running"},
}


def test_a_full_object_reads_through_the_views() -> None:
    body = Body(POD)
    assert body.raw is POD
    m = body.meta
    assert (m.name, m.namespace, m.uid, m.resource_version) == ("p", "ns", "u-1", "42")
    assert m.generation == 3
    assert m.creation_timestamp == "2026-01-01T00:00:00Z"
    assert m.deletion_timestamp is None
    assert m.labels == {"a": "1"} and m.annotations == {"b": "2"}
    assert m.owner_references == [{"kind": "PyTorchJob", "name": "j"}]
    assert body.spec == {"containers": []} and body.status == {"phase": "Running"}
    assert meta_of(POD).name == "p"


@pytest.mark.parametrize(
    "obj",
    [None, {}, {"metadata": None}, {"metadata": {}}, {"metadata": {"labels": None}}],
)
def test_missing_levels_read_as_empty(obj: dict[str, Any] | None) -> None:
    m = meta_of(obj)
    assert m.name is None and m.namespace is None and m.uid is None
    assert m.labels == {} and m.annotations == {} and m.owner_references == ()
    assert Body(obj).spec == {} and Body(obj).status == {}


def test_a_view_is_a_read_only_mapping_of_the_raw_keys() -> None:
    m = Meta(POD["metadata"])
    assert m["name"] == "p" and m.get("missing", "d") == "d"
    assert set(m) == set(POD["metadata"]) and len(m) == len(POD["metadata"])
    assert dict(m) == POD["metadata"]
    with pytest.raises(TypeError):
        m["name"] = "q"  # type: ignore[index]


def test_continue_token() -> None:
    assert continue_token({"metadata": {"continue": "t"}}) == "t"
    assert continue_token({"metadata": {"continue": ""}}) is None
    assert continue_token({}) is None

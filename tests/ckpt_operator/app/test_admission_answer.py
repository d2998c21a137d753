"""The kopf internals :mod:`ckpt_operator.app.admission_answer` relies on (see its docstring).

These fail on a kopf upgrade that changes how its admission engine builds the answer, or
how a ``kopf.Patch`` turns into JSON Patch: then the operator's answers would silently be
rebuilt by kopf's deep-copy-and-diff (correct, but the fleet-scale cost of issue #19).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import inspect
import json
from typing import Any

import kopf
import pytest
from kopf._cogs.structs import references
from kopf._core.engines import admission

from ckpt_operator.app.admission_answer import answer_with
from ckpt_operator.model.jsonpatch import JSONPatchOp, apply_patch

POD: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "p", "namespace": "ns", "labels": {"a": "1"}},
    "spec": {"containers": [{"name": "trainer", "image": "x"}]},
}
OPS: list[JSONPatchOp] = [
    {"op": "add", "path": "/metadata/annotations", "value": {"ckpt.dev/injected": "v1"}},
    {"op": "add", "path": "/spec/volumes", "value": [{"name": "v", "emptyDir": {}}]},
]
PODS = references.Resource(
    group="",
    version="v1",
    plural="pods",
    kind="Pod",
    singular="pod",
    namespaced=True,
    verbs=frozenset({"create", "get", "list", "watch", "patch"}),
)


class _Memos(admission.MemoGetter):
    async def recall_memo(
        self, raw_body: Any, *, memobase: Any = None, ephemeral: bool = False
    ) -> Any:
        return kopf.Memo()


def _serve(ops: list[JSONPatchOp]) -> dict[str, Any]:
    """One admission review through kopf's own engine, with a handler answering ``ops``."""
    registry = kopf.OperatorRegistry()

    @kopf.on.mutate("pods", id="inject", registry=registry)
    def _inject(patch: kopf.Patch, **_: Any) -> None:
        answer_with(patch, ops)

    insights = references.Insights()
    insights.webhook_resources.add(PODS)
    request: Any = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "operation": "CREATE",
            "userInfo": {"username": "test"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "object": copy.deepcopy(POD),
        },
    }
    response = asyncio.run(
        admission.serve_admission_request(
            request,
            webhook=kopf.HandlerId("inject"),
            settings=kopf.OperatorSettings(),
            memories=_Memos(),
            memobase=kopf.Memo(),
            registry=registry,
            insights=insights,
            indices={},
        )
    )
    return dict(response["response"])


def _kopf_diff_forbidden(self: kopf.Patch, body: Any = None) -> Any:
    raise AssertionError("kopf diffed a copy of the object: answer_with's shadow was bypassed")


def test_kopfs_engine_answers_with_our_ops_as_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kopf.Patch, "as_json_patch", _kopf_diff_forbidden)
    answer = _serve(OPS)
    assert answer["allowed"] is True and answer["patchType"] == "JSONPatch"
    assert json.loads(base64.b64decode(answer["patch"])) == OPS


def test_a_validation_answers_without_a_patch_and_without_kopfs_diff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kopf.Patch, "as_json_patch", _kopf_diff_forbidden)
    answer = _serve([])
    assert answer["allowed"] is True and "patch" not in answer


def test_the_engine_still_reads_the_answer_from_the_handlers_patch() -> None:
    """The line the shadow relies on (a reworded one needs a look, even if equivalent)."""
    source = inspect.getsource(admission.serve_admission_request)
    assert "patch = patches.Patch(body=body)" in source
    assert "patch=patch," in source
    assert "jsonpatch=patch.as_json_patch()" in source


def test_a_patch_takes_the_shadow_and_kopfs_own_answer_is_the_same_patch() -> None:
    """Should kopf bypass the shadow, ``patch.fns`` still carry the ops: its own diff is
    the same change (maybe spelled differently)."""
    assert not hasattr(kopf.Patch, "__slots__") or "__dict__" in kopf.Patch.__slots__
    assert inspect.isfunction(inspect.getattr_static(kopf.Patch, "as_json_patch"))
    patch = kopf.Patch(body=kopf.Body(copy.deepcopy(POD)))
    answer_with(patch, OPS)
    assert patch.as_json_patch() == OPS
    kopfs = kopf.Patch.as_json_patch(patch)  # the method itself, not the shadow
    assert apply_patch(copy.deepcopy(POD), kopfs) == apply_patch(copy.deepcopy(POD), OPS)

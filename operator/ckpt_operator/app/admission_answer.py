"""The admission webhooks' answer: our own JSON Patch ops, not kopf's diff of a copy.

kopf has no API for a handler to answer with JSON Patch ops: it applies the handler's
merge patch and ``patch.fns`` to a deep copy of the request's object and diffs the two
(:meth:`kopf.Patch.as_json_patch`), the webhook's largest cost at fleet scale (issue #19),
and it deep-copies the object even when there is nothing to patch. :func:`answer_with`
therefore shadows that method on the one :class:`kopf.Patch` of the request, relying on
two kopf internals that ``tests/ckpt_operator/app/test_admission_answer.py`` pins (it
fails on a kopf upgrade that changes either):

1. kopf's admission engine (``kopf._core.engines.admission.serve_admission_request``)
   builds the response from ``patch.as_json_patch()``, called without arguments on the
   very ``Patch`` it passed to the handlers;
2. ``kopf.Patch`` takes instance attributes (no ``__slots__``) and ``as_json_patch`` is a
   plain method, so an instance attribute shadows it.

Should either change, kopf would compute the answer itself from ``patch.fns`` (they still
carry the ops): the same patch, only slower — the test says which assumption broke.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import kopf

from ckpt_operator.model.jsonpatch import JSONPatchOp, apply_patch_in_place

__all__ = ["answer_with"]


def _apply(ops: list[JSONPatchOp], body: Any) -> None:
    apply_patch_in_place(cast(dict[str, Any], body), ops)


def answer_with(patch: kopf.Patch, ops: list[JSONPatchOp]) -> None:
    """Answer the admission request with ``ops`` themselves (RFC 6902 against the request's
    object, which is what they were built from); ``[]`` for a validation, which has no
    patch to build (kopf would deep-copy the object to find that out)."""
    if ops:
        patch.fns.append(functools.partial(_apply, ops))
    answer = [cast(dict[str, Any], dict(op)) for op in ops]
    setattr(patch, "as_json_patch", lambda body=None: answer)  # noqa: B010

"""The Secret the operator issues for a replicating job (planners.replica_secret)."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from ckpt_operator.kinds.pytorchjob import PYTORCHJOB
from ckpt_operator.kinds.trainjob import TRAINJOB
from ckpt_operator.planners.replica_secret import ISSUED_BY_LABEL, replica_secret

KEY = "0123456789abcdef" * 4


def _job(name: str = "bert", **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "team-a", "uid": "u-1", **meta}}


def test_an_opaque_secret_named_for_the_job_owned_by_it_holding_the_key() -> None:
    s = replica_secret(_job(), PYTORCHJOB, KEY)
    assert (s["kind"], s["type"]) == ("Secret", "Opaque")
    meta = s["metadata"]
    assert (meta["name"], meta["namespace"]) == ("ckpt-replica-bert", "team-a")
    assert meta["labels"][ISSUED_BY_LABEL] == "issued"
    assert meta["ownerReferences"] == [
        {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "bert", "uid": "u-1"}
    ]
    assert base64.b64decode(s["data"]["secret"]).decode() == KEY
    assert set(s["data"]) == {"secret"}


def test_a_trainjob_owns_its_secret_and_a_long_name_is_cut_with_a_digest() -> None:
    s = replica_secret(_job("t" * 250), TRAINJOB, KEY)
    assert s["metadata"]["ownerReferences"][0]["kind"] == "TrainJob"
    assert s["metadata"]["ownerReferences"][0]["apiVersion"].startswith("trainer.kubeflow.org/")
    assert len(s["metadata"]["name"]) <= 253 and s["metadata"]["name"].startswith("ckpt-replica-")


@pytest.mark.parametrize("key", ["", KEY[:-1], KEY.upper(), KEY[:-1] + "g", KEY + "00"])
def test_a_key_that_is_not_64_lowercase_hex_digits_is_refused(key: str) -> None:
    with pytest.raises(ValueError, match="64 lowercase hex digits"):
        replica_secret(_job(), PYTORCHJOB, key)


@pytest.mark.parametrize("missing", ["name", "namespace", "uid"])
def test_a_job_without_name_namespace_or_uid_cannot_own_it(missing: str) -> None:
    job = _job()
    del job["metadata"][missing]
    with pytest.raises(ValueError, match="name, a namespace and a uid"):
        replica_secret(job, PYTORCHJOB, KEY)

"""The job webhooks' match conditions, as the API server applies them (issue #19).

``validate.pytorchjobs.ckpt.dev`` refuses a PyTorchJob whose checked ``ckpt.dev``
annotation (run id, resume point, restart count, manual recovery...) is malformed, on
create and when an update sets or changes one, naming the annotation. Its
``matchConditions`` make the API server call it only for such writes: a job without
them, and an update that leaves them as they are (the operator's own PATCHes, the
training-operator's updates), never reach the operator — counted by the API server's
admission metrics. Likewise ``label.pytorchjobs.ckpt.dev`` is called for an opted-in job
with an unlabelled pod template, never for one whose templates all carry
``ckpt.dev/inject`` (the operator's restarts).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from ckpt_e2e.errors import ApiError
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import Training, pytorchjob_manifest

pytestmark = pytest.mark.e2e

WEBHOOK = "validate.pytorchjobs.ckpt.dev"
_CALLS = re.compile(
    r"^apiserver_admission_webhook_admission_duration_seconds_count\{(?P<labels>[^}]*)\} "
    r"(?P<value>\S+)$",
    re.MULTILINE,
)


LABEL_WEBHOOK = "label.pytorchjobs.ckpt.dev"
INJECT = "ckpt.dev/inject"


def _calls(scenario: Scenario, webhook: str = WEBHOOK) -> int:
    """The API server's calls of ``webhook`` so far."""
    text = scenario.cluster.kubectl("get", "--raw", "/metrics").stdout
    return sum(
        int(float(m["value"])) for m in _CALLS.finditer(text) if f'name="{webhook}"' in m["labels"]
    )


def _refusal(err: pytest.ExceptionInfo[ApiError]) -> str:
    assert err.value.status == 422, err.value
    message: str = json.loads(err.value.body)["message"]
    assert f'admission webhook "{WEBHOOK}" denied the request' in message, message
    return message


def test_job_webhooks_are_called_only_for_writes_they_can_act_on(
    scenario: Scenario,
) -> None:
    cluster, ns = scenario.cluster, scenario.namespace
    jobs = f"/apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs"

    def manifest(name: str, annotations: dict[str, str]) -> dict[str, object]:
        m = pytorchjob_manifest(name, Training(steps=5), scenario.results, auto_resume=False)
        m["metadata"] = (
            {"name": name, "annotations": annotations} if annotations else {"name": name}
        )
        m["spec"]["runPolicy"] = {"suspend": True}  # no pods: admission is the point
        return m

    # create: a bad checked annotation is refused, naming it
    with pytest.raises(ApiError) as bad:
        cluster.request("POST", jobs, manifest("bad", {"ckpt.dev/resume-step": "latest"}))
    assert "ckpt.dev/resume-step='latest'" in _refusal(bad)
    with pytest.raises(ApiError) as unsigned:
        cluster.request("POST", jobs, manifest("bad", {"ckpt.dev/recover-step": "10"}))
    assert "needs ckpt.dev/recover-by" in _refusal(unsigned)

    # a job without annotations, or without checked ones: no call
    before = _calls(scenario)
    cluster.request("POST", jobs, manifest("plain", {}))
    cluster.request("POST", jobs, manifest("other", {"team": "ml"}))
    # a valid checked annotation: called (and admitted)
    cluster.request("POST", jobs, manifest("good", {"ckpt.dev/restart-count": "1"}))
    assert _calls(scenario) == before + 1

    # updates that leave the checked annotations as they are: no call
    before = _calls(scenario)
    cluster.request("PATCH", f"{jobs}/good", {"metadata": {"annotations": {"team": "ml"}}})
    cluster.request("PATCH", f"{jobs}/good", {"metadata": {"labels": {"tier": "a"}}})
    cluster.request(
        "PATCH", f"{jobs}/good", {"metadata": {"annotations": {"ckpt.dev/restart-count": "1"}}}
    )
    cluster.request("PATCH", f"{jobs}/plain", {"metadata": {"labels": {"tier": "a"}}})
    assert _calls(scenario) == before

    # an update that sets or changes one: called, and refused when it is bad
    with pytest.raises(ApiError) as changed:
        cluster.request(
            "PATCH", f"{jobs}/good", {"metadata": {"annotations": {"ckpt.dev/restart-count": "x"}}}
        )
    assert "ckpt.dev/restart-count='x'" in _refusal(changed)
    with pytest.raises(ApiError) as added:
        cluster.request(
            "PATCH", f"{jobs}/plain", {"metadata": {"annotations": {"ckpt.dev/run-id": "../x"}}}
        )
    assert "ckpt.dev/run-id='../x'" in _refusal(added)
    cluster.request(
        "PATCH", f"{jobs}/good", {"metadata": {"annotations": {"ckpt.dev/restart-count": "2"}}}
    )
    assert _calls(scenario) == before + 3
    job = scenario.job("good")
    assert job is not None
    assert job["metadata"]["annotations"]["ckpt.dev/restart-count"] == "2"

    # (one test: each scenario costs a fresh operator) the label webhook is called for an
    # opted-in job with an unlabelled pod template only
    def opted_in(name: str, labelled: bool) -> dict[str, Any]:
        m = pytorchjob_manifest(name, Training(steps=5), scenario.results, policy="absent")
        m["spec"]["runPolicy"] = {"suspend": True}  # no pods: admission is the point
        if labelled:  # as the operator creates a restart: its templates copied, labelled
            for rspec in m["spec"]["pytorchReplicaSpecs"].values():
                rspec["template"].setdefault("metadata", {})["labels"] = {INJECT: "true"}
        return m

    before = _calls(scenario, LABEL_WEBHOOK)
    created = cluster.request("POST", jobs, opted_in("first", labelled=False))
    assert _calls(scenario, LABEL_WEBHOOK) == before + 1
    for rspec in created["spec"]["pytorchReplicaSpecs"].values():
        assert rspec["template"]["metadata"]["labels"][INJECT] == "true"
    cluster.request("POST", jobs, opted_in("restart", labelled=True))
    assert _calls(scenario, LABEL_WEBHOOK) == before + 1

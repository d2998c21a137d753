"""The injection builder against the pod the training-operator really submits."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from ckpt_agent.policy import AgentConfig, CheckpointPolicySpec
from ckpt_operator.model import constants as c
from ckpt_operator.model.jsonpatch import apply_patch
from ckpt_operator.planners.injection import (
    InjectionContext,
    build_config_map,
    build_pod_patch,
    config_map_name,
)

RUN_ID = "mnist-ddp-5f0c6a7e"


def admitted_pod(fixture: Any) -> dict[str, Any]:
    return fixture("admission_review_pod.json")["request"]["object"]


def policy_spec(fixture: Any, **changes: Any) -> CheckpointPolicySpec:
    spec = fixture("checkpointpolicy.json")["spec"]
    for path, value in changes.items():
        node = spec
        keys = path.split("__")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return CheckpointPolicySpec.model_validate(spec)


def ctx(**kw: Any) -> InjectionContext:
    base: dict[str, Any] = {"policy_name": "llm-finetune", "run_id": RUN_ID}
    base.update(kw)
    return InjectionContext(**base)


def container(pod: dict[str, Any], name: str = "pytorch") -> dict[str, Any]:
    return next(x for x in pod["spec"]["containers"] if x["name"] == name)


def env_of(ctr: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in ctr.get("env", [])}


def test_injects_env_volumes_and_port_into_training_container(fixture: Any) -> None:
    pod = admitted_pod(fixture)
    result = build_pod_patch(pod, policy_spec(fixture), {}, ctx())
    assert result.injected and result.skipped is None and not result.already_injected
    out = apply_patch(pod, result.ops)

    env = env_of(container(out))
    # the training-operator's own variables survive untouched
    assert env["MASTER_ADDR"] == "mnist-ddp-master-0" and env["RANK"] == "1"
    assert env["CKPT_CONFIG"] == "/etc/ckpt/config.json"
    assert env["CKPT_RUN_ID"] == RUN_ID
    assert env["CKPT_STORAGE_URL"] == "s3://ml-checkpoints/team-a"
    assert env["CKPT_SHM_DIR"] == c.SHM_DIR
    assert env["CKPT_SIGNAL_FILE"] == "/var/run/ckpt/signal/save-now"
    assert env["CKPT_METRICS_PORT"] == "9400"
    assert env["CKPT_WORK_DIR"] == c.WORK_DIR
    assert env["CKPT_S3_ENDPOINT_URL"] == "http://minio.storage.svc:9000"
    assert env["CKPT_S3_PATH_STYLE"] == "true"
    assert "CKPT_RESUME_FROM" not in env  # first run

    vols = {v["name"]: v for v in out["spec"]["volumes"]}
    assert "kube-api-access-x7k2p" in vols
    assert vols["ckpt-config"]["configMap"]["name"] == "ckpt-llm-finetune"
    assert vols["ckpt-shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2048Mi"}
    signal = vols["ckpt-signal"]["downwardAPI"]["items"][0]
    assert signal["path"] == "save-now"
    assert signal["fieldRef"]["fieldPath"] == "metadata.annotations['ckpt.dev/save-now']"
    assert "ckpt-storage" not in vols  # S3: nothing to mount

    mounts = {m["mountPath"]: m for m in container(out)["volumeMounts"]}
    assert mounts["/etc/ckpt"]["readOnly"] is True
    assert mounts["/var/run/ckpt/signal"]["readOnly"] is True
    assert (
        mounts["/var/run/secrets/kubernetes.io/serviceaccount"]["name"] == "kube-api-access-x7k2p"
    )

    ports = container(out)["ports"]
    assert {"name": "ckpt-metrics", "containerPort": 9400, "protocol": "TCP"} in ports
    assert ports[0]["name"] == "pytorchjob-port"

    assert out["metadata"]["annotations"][c.ANN_INJECTED] == "v1"
    assert out["metadata"]["labels"][c.LABEL_INJECTED] == "true"
    # the training-operator's init container is left alone and no sidecar was added
    assert [i["name"] for i in out["spec"]["initContainers"]] == ["init-pytorch"]


def test_secrets_are_references_never_values(fixture: Any) -> None:
    pod = admitted_pod(fixture)
    result = build_pod_patch(pod, policy_spec(fixture), {}, ctx())
    env = {e["name"]: e for e in container(apply_patch(pod, result.ops))["env"]}
    for name, key in (
        ("CKPT_S3_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID"),
        ("CKPT_S3_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY"),
    ):
        assert "value" not in env[name]
        assert env[name]["valueFrom"] == {
            "secretKeyRef": {"name": "ckpt-s3-credentials", "key": key}
        }
    # and nothing secret-looking went in as a literal
    text = json.dumps(result.ops)
    assert 'AWS_SECRET_ACCESS_KEY"' not in text.replace('"key": "AWS_SECRET_ACCESS_KEY"', "")


def test_resume_point_and_run_id_come_from_the_job(fixture: Any) -> None:
    pod = admitted_pod(fixture)
    job_ann = {
        c.ANN_RUN_ID: "mnist-ddp-5f0c6a7e",
        c.ANN_RESUME_FROM: "pulse_step_000000001200",
        c.ANN_RESTART_COUNT: "1",
    }
    result = build_pod_patch(pod, policy_spec(fixture), job_ann, ctx(run_id="ignored"))
    out = apply_patch(pod, result.ops)
    env = env_of(container(out))
    assert env["CKPT_RESUME_FROM"] == "pulse_step_000000001200"
    assert env["CKPT_RUN_ID"] == "mnist-ddp-5f0c6a7e"
    assert out["metadata"]["annotations"][c.ANN_RESUME_FROM] == "pulse_step_000000001200"


def test_reinjection_is_a_no_op(fixture: Any) -> None:
    pod = admitted_pod(fixture)
    spec = policy_spec(fixture, agent__sidecar=True, agent__image="ghcr.io/x/agent:0.1.0")
    first = build_pod_patch(pod, spec, {}, ctx())
    patched = apply_patch(pod, first.ops)
    again = build_pod_patch(patched, spec, {}, ctx())
    assert again.ops == [] and again.already_injected and again.skipped is None


def test_sidecar_is_a_native_sidecar_with_same_env_and_mounts(fixture: Any) -> None:
    pod = admitted_pod(fixture)
    spec = policy_spec(fixture, agent__sidecar=True, agent__image="ghcr.io/x/agent:0.1.0")
    out = apply_patch(pod, build_pod_patch(pod, spec, {}, ctx()).ops)
    init = out["spec"]["initContainers"]
    assert [i["name"] for i in init] == ["init-pytorch", "ckpt-agent"]
    sc = init[1]
    assert sc["restartPolicy"] == "Always"
    assert sc["image"] == "ghcr.io/x/agent:0.1.0"
    assert sc["command"] == ["ckpt", "sidecar"]
    assert env_of(sc)["CKPT_METRICS_PORT"] == "9401"
    assert env_of(sc)["CKPT_RUN_ID"] == RUN_ID
    assert {m["mountPath"] for m in sc["volumeMounts"]} == {
        m["mountPath"] for m in container(out)["volumeMounts"] if m["name"].startswith("ckpt-")
    }
    assert sc["securityContext"]["readOnlyRootFilesystem"] is True


def test_sidecar_without_image_falls_back_to_in_process(fixture: Any) -> None:
    pod = admitted_pod(fixture)
    spec = policy_spec(fixture, agent__sidecar=True)
    result = build_pod_patch(pod, spec, {}, ctx(agent_image=""))
    assert result.injected
    assert any("no agent image" in n for n in result.notes)
    out = apply_patch(pod, result.ops)
    assert [i["name"] for i in out["spec"]["initContainers"]] == ["init-pytorch"]
    # the operator-wide default image is used when the policy names none
    result = build_pod_patch(pod, spec, {}, ctx(agent_image="registry/agent:1"))
    out = apply_patch(pod, result.ops)
    assert out["spec"]["initContainers"][1]["image"] == "registry/agent:1"


def test_local_pvc_storage_is_mounted_at_its_path(fixture: Any) -> None:
    pod = admitted_pod(fixture)
    spec = policy_spec(
        fixture, storage={"type": "local", "local": {"path": "/mnt/ckpt", "pvcName": "ckpt-pvc"}}
    )
    out = apply_patch(pod, build_pod_patch(pod, spec, {}, ctx()).ops)
    vols = {v["name"]: v for v in out["spec"]["volumes"]}
    assert vols["ckpt-storage"] == {
        "name": "ckpt-storage",
        "persistentVolumeClaim": {"claimName": "ckpt-pvc"},
    }
    assert {"name": "ckpt-storage", "mountPath": "/mnt/ckpt"} in container(out)["volumeMounts"]
    env = env_of(container(out))
    assert env["CKPT_STORAGE_URL"] == "file:///mnt/ckpt"
    assert not any(k.startswith("CKPT_S3_") for k in env)


def test_users_own_storage_mount_is_kept(fixture: Any) -> None:
    pod = admitted_pod(fixture)
    container(pod)["volumeMounts"].append({"name": "data", "mountPath": "/mnt/ckpt/"})
    pod["spec"]["volumes"].append({"name": "data", "nfs": {"server": "nfs", "path": "/x"}})
    spec = policy_spec(
        fixture, storage={"type": "local", "local": {"path": "/mnt/ckpt", "pvcName": "ckpt-pvc"}}
    )
    result = build_pod_patch(pod, spec, {}, ctx())
    out = apply_patch(pod, result.ops)
    assert "ckpt-storage" not in {v["name"] for v in out["spec"]["volumes"]}
    assert any("already mounted" in n for n in result.notes)


def test_user_env_values_win_and_are_noted(fixture: Any) -> None:
    pod = admitted_pod(fixture)
    container(pod)["env"].append({"name": "CKPT_METRICS_PORT", "value": "0"})
    result = build_pod_patch(pod, policy_spec(fixture), {}, ctx())
    env = container(apply_patch(pod, result.ops))["env"]
    assert [e for e in env if e["name"] == "CKPT_METRICS_PORT"] == [
        {"name": "CKPT_METRICS_PORT", "value": "0"}
    ]
    assert any("CKPT_METRICS_PORT" in n for n in result.notes)


def test_pod_without_lists_gets_them_created(fixture: Any) -> None:
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ml-team"},
        "spec": {"containers": [{"name": "pytorch", "image": "x"}]},
    }
    out = apply_patch(pod, build_pod_patch(pod, policy_spec(fixture), {}, ctx()).ops)
    assert out["metadata"]["annotations"][c.ANN_INJECTED] == "v1"
    assert out["metadata"]["labels"] == {c.LABEL_INJECTED: "true"}
    assert len(out["spec"]["volumes"]) == 4
    assert container(out)["ports"] == [
        {"name": "ckpt-metrics", "containerPort": 9400, "protocol": "TCP"}
    ]


def test_annotation_keys_with_slashes_are_escaped(fixture: Any) -> None:
    pod = admitted_pod(fixture)
    pod["metadata"]["annotations"] = {"existing": "1"}
    result = build_pod_patch(pod, policy_spec(fixture), {}, ctx())
    paths = [op["path"] for op in result.ops if op["path"].startswith("/metadata/annotations")]
    assert "/metadata/annotations/ckpt.dev~1injected" in paths
    assert apply_patch(pod, result.ops)["metadata"]["annotations"]["existing"] == "1"


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (
            lambda p: p["spec"]["containers"][0].update(name="trainer"),
            "no container named 'pytorch'",
        ),
        (
            lambda p: p["spec"]["volumes"].append({"name": "ckpt-shm", "emptyDir": {}}),
            "volume name(s) ckpt-shm already used",
        ),
        (
            lambda p: p["spec"]["containers"][0]["volumeMounts"].append(
                {"name": "cfg", "mountPath": "/etc/ckpt"}
            ),
            "mount path(s) /etc/ckpt already used",
        ),
        (lambda p: p.pop("spec"), "no pod spec"),
    ],
    ids=["no-training-container", "volume-name-taken", "mount-path-taken", "not-a-pod"],
)
def test_pods_it_cannot_handle_get_no_ops_and_a_reason(
    fixture: Any, mutate: Any, reason: str
) -> None:
    pod = admitted_pod(fixture)
    mutate(pod)
    result = build_pod_patch(pod, policy_spec(fixture), {}, ctx())
    assert result.ops == []
    assert result.skipped is not None and reason in result.skipped


def test_sidecar_name_clash_is_refused(fixture: Any) -> None:
    pod = admitted_pod(fixture)
    pod["spec"]["containers"].append({"name": "ckpt-agent", "image": "x"})
    spec = policy_spec(fixture, agent__sidecar=True, agent__image="a:1")
    result = build_pod_patch(pod, spec, {}, ctx())
    assert result.ops == [] and result.skipped and "ckpt-agent" in result.skipped


def test_existing_metrics_port_is_not_duplicated(fixture: Any) -> None:
    pod = admitted_pod(fixture)
    container(pod)["ports"].append({"name": "metrics", "containerPort": 9400})
    result = build_pod_patch(pod, policy_spec(fixture), {}, ctx())
    ports = container(apply_patch(pod, result.ops))["ports"]
    assert [p["containerPort"] for p in ports].count(9400) == 1


def test_config_map_holds_the_agent_config_owned_by_the_policy(fixture: Any) -> None:
    policy = fixture("checkpointpolicy.json")
    spec = CheckpointPolicySpec.model_validate(policy["spec"])
    cm = build_config_map("llm-finetune", "ml-team", spec, policy["metadata"]["uid"])
    assert cm["metadata"]["name"] == "ckpt-llm-finetune" == config_map_name("llm-finetune")
    assert cm["metadata"]["ownerReferences"][0]["uid"] == policy["metadata"]["uid"]
    config = AgentConfig.from_json(cm["data"]["config.json"])
    assert config.storage_url == "s3://ml-checkpoints/team-a"
    assert config.signal_file == c.SIGNAL_FILE
    assert config.to_policy_spec() == spec  # lossless: the file describes the policy
    # and the secret's *name* is there, never a value
    assert "ckpt-s3-credentials" in cm["data"]["config.json"]


def test_config_map_name_stays_a_valid_name() -> None:
    long = "p" * 253
    name = config_map_name(long)
    assert len(name) <= 253 and name.startswith("ckpt-p")
    assert config_map_name(long) == name


def test_does_not_mutate_its_input(fixture: Any) -> None:
    pod = admitted_pod(fixture)
    before = copy.deepcopy(pod)
    build_pod_patch(pod, policy_spec(fixture), {}, ctx())
    assert pod == before


def test_agent_is_told_where_its_termination_message_goes(fixture: Any) -> None:
    pod = admitted_pod(fixture)
    container(pod).pop("terminationMessagePath", None)
    container(pod).pop("terminationMessagePolicy", None)
    spec = policy_spec(fixture, agent__sidecar=True, agent__image="ghcr.io/x/agent:0.1.0")
    out = apply_patch(pod, build_pod_patch(pod, spec, {}, ctx()).ops)
    ctr = container(out)
    assert ctr["terminationMessagePath"] == "/dev/termination-log"
    assert ctr["terminationMessagePolicy"] == "File"
    assert env_of(ctr)["CKPT_TERMINATION_LOG"] == "/dev/termination-log"
    sc = out["spec"]["initContainers"][-1]  # its own container, its own file
    assert sc["terminationMessagePath"] == "/dev/termination-log"
    assert env_of(sc)["CKPT_TERMINATION_LOG"] == "/dev/termination-log"


def test_a_custom_termination_message_path_is_kept(fixture: Any) -> None:
    pod = admitted_pod(fixture)
    container(pod)["terminationMessagePath"] = "/tmp/why"
    container(pod)["terminationMessagePolicy"] = "FallbackToLogsOnError"
    out = apply_patch(pod, build_pod_patch(pod, policy_spec(fixture), {}, ctx()).ops)
    ctr = container(out)
    assert ctr["terminationMessagePath"] == "/tmp/why"
    assert ctr["terminationMessagePolicy"] == "FallbackToLogsOnError"  # a report wins anyway
    assert env_of(ctr)["CKPT_TERMINATION_LOG"] == "/tmp/why"


def test_pod_and_node_names_come_from_the_downward_api(fixture: Any) -> None:
    """The writer record of a fenced run names the pod and node (#28): the training
    container and the sidecar (the sidecar claims when it persists) get both."""
    pod = admitted_pod(fixture)
    spec = policy_spec(fixture, agent__sidecar=True, agent__image="ghcr.io/x/agent:0.1.0")
    out = apply_patch(pod, build_pod_patch(pod, spec, {}, ctx()).ops)
    for ctr in (container(out), out["spec"]["initContainers"][1]):
        env = env_of(ctr)
        assert env["CKPT_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["CKPT_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        assert env["CKPT_POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}


def test_a_users_own_pod_name_env_is_kept(fixture: Any) -> None:
    pod = admitted_pod(fixture)
    container(pod)["env"].append({"name": "CKPT_POD_NAME", "value": "mine"})
    result = build_pod_patch(pod, policy_spec(fixture), {}, ctx())
    env = container(apply_patch(pod, result.ops))["env"]
    assert [e for e in env if e["name"] == "CKPT_POD_NAME"] == [
        {"name": "CKPT_POD_NAME", "value": "mine"}
    ]
    assert env_of({"env": env})["CKPT_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


# --------------------------------------------------------------------------- termination grace (#30)


def _grace(fixture: Any, job_annotations: dict[str, str], **preemption: Any) -> Any:
    pod = admitted_pod(fixture)
    spec = policy_spec(fixture)
    spec.preemption = spec.preemption.model_copy(update=preemption)
    result = build_pod_patch(pod, spec, job_annotations, ctx())
    return apply_patch(pod, result.ops)["spec"].get("terminationGracePeriodSeconds")


def test_grace_is_raised_to_cover_the_measured_save(fixture: Any) -> None:
    assert _grace(fixture, {"ckpt.dev/save-seconds": "100"}) == 115  # save + margin


def test_grace_without_a_measurement_covers_the_default_save(fixture: Any) -> None:
    assert _grace(fixture, {}) == 75  # DEFAULT_SAVE_SECONDS 60 + 15


def test_grace_is_bounded_by_max_grace_seconds(fixture: Any) -> None:
    assert _grace(fixture, {"ckpt.dev/save-seconds": "900"}, max_grace_seconds=200) == 200


def test_grace_never_lowers_the_pods_own(fixture: Any) -> None:
    pod = admitted_pod(fixture)
    pod["spec"]["terminationGracePeriodSeconds"] = 600
    result = build_pod_patch(pod, policy_spec(fixture), {"ckpt.dev/save-seconds": "100"}, ctx())
    assert result.injected
    assert not [op for op in result.ops if op["path"] == "/spec/terminationGracePeriodSeconds"]


def test_grace_is_left_alone_without_save_on_eviction(fixture: Any) -> None:
    own = admitted_pod(fixture)["spec"].get("terminationGracePeriodSeconds")
    assert _grace(fixture, {"ckpt.dev/save-seconds": "100"}, save_on_eviction=False) == own

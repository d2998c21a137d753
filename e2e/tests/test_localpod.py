"""The local-process stand-in for a pod's container (ckpt_e2e.localpod) against the real
API server: env resolution, volumes, path translation, live downward-API updates,
deletion with SIGTERM, and the exit report."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import pytest

from ckpt_e2e import LocalCluster, LocalPod, LocalPodError, PathTranslator, pvc_path
from ckpt_e2e.podspec import native_sidecars, select_container

pytestmark = pytest.mark.e2e

# The "training" program: dumps what it sees, then waits for the downward-API annotation
# file to announce a save request, writes it to the PVC and exits 0.
PROGRAM = r"""
import json, os, pathlib, sys, time
out = pathlib.Path(os.environ["OUT_DIR"])
cfg = json.loads(pathlib.Path(os.environ["CKPT_CONFIG"]).read_text())
seen = {
    "env": {k: os.environ.get(k) for k in ["POD_NAME", "NODE", "S3_KEY", "MODE", "mode",
                                           "STORAGE", "DERIVED", "CKPT_E2E_PATH_MAP"]},
    "argv": sys.argv[1:],
    "cwd": os.getcwd(),
    "config": cfg,
}
(out / "seen.json").write_text(json.dumps(seen))
ann = pathlib.Path(os.environ["PODINFO"]) / "annotations"
deadline = time.time() + 60
while time.time() < deadline:
    if 'ckpt.dev/save-now="req-7"' in ann.read_text():
        pathlib.Path(cfg["storage"], "saved").write_text("req-7")
        sys.exit(0)
    time.sleep(0.2)
sys.exit(9)
"""

SIGTERM_PROGRAM = r"""
import os, pathlib, signal, sys, time
def term(*_):
    pathlib.Path(os.environ["MARK"]).write_text("got SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
pathlib.Path(os.environ["MARK"] + ".started").write_text("1")
time.sleep(120)
sys.exit(5)
"""


def _pod(name: str, containers: list[dict[str, Any]], volumes: list[dict[str, Any]]) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "annotations": {"ckpt.dev/save-now": ""}},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 20,
                "containers": containers,
                "volumes": volumes,
            },
        }
    )


def test_path_translator() -> None:
    t = PathTranslator({"/ckpt": "/tmp/x/ckpt", "/ckpt/inner": "/tmp/y", "/etc/c.json": "/tmp/c"})
    assert t.text("/ckpt") == "/tmp/x/ckpt"
    assert t.text("file:///ckpt/run-1") == "file:///tmp/x/ckpt/run-1"
    assert t.text("--out=/ckpt/a,/ckpt/inner/b") == "--out=/tmp/x/ckpt/a,/tmp/y/b"
    assert t.text("/ckpt-other /data/ckpt") == "/ckpt-other /data/ckpt"
    assert t.text('{"c": "/etc/c.json"}') == '{"c": "/tmp/c"}'


def test_local_pod_env_volumes_and_downward_api(cluster: LocalCluster, namespace: str) -> None:
    cluster.kubectl(
        "create", "secret", "generic", "s3", "--from-literal=key=s3cr3t", "-n", namespace
    )
    config = {"storage": "/ckpt/run-1", "shm": "/dev/shm"}
    cluster.kubectl(
        "create",
        "configmap",
        "ckpt-config",
        f"--from-literal=config.json={json.dumps(config)}",
        "--from-literal=mode=fast",
        "-n",
        namespace,
    )
    data_dir = cluster.create_pvc(namespace, "ckpt-data")
    assert data_dir == pvc_path(cluster, namespace, "ckpt-data")
    container: dict[str, Any] = {
        "name": "pytorch",
        "image": "none",
        "command": ["python", "-c", PROGRAM],
        "args": ["--storage=/ckpt/run-1", "$(MODE)"],
        "workingDir": "/workspace",
        "env": [
            {"name": "OUT_DIR", "value": "/out"},
            {"name": "CKPT_CONFIG", "value": "/etc/ckpt/config.json"},
            {"name": "PODINFO", "value": "/etc/podinfo"},
            {"name": "STORAGE", "value": "file:///ckpt/run-1"},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "S3_KEY", "valueFrom": {"secretKeyRef": {"name": "s3", "key": "key"}}},
            {"name": "DERIVED", "value": "$(POD_NAME)-$$(x)"},
        ],
        "envFrom": [{"configMapRef": {"name": "ckpt-config"}, "prefix": ""}],
        "volumeMounts": [
            {"name": "out", "mountPath": "/out"},
            {"name": "work", "mountPath": "/workspace"},
            {"name": "cfg", "mountPath": "/etc/ckpt"},
            {"name": "podinfo", "mountPath": "/etc/podinfo"},
            {"name": "data", "mountPath": "/ckpt"},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    # envFrom exports the configmap keys as they are ("mode"); MODE comes from a key ref
    container["env"].append(
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "ckpt-config", "key": "mode"}}}
    )
    volumes = [
        {"name": "out", "emptyDir": {}},
        {"name": "work", "emptyDir": {}},
        {
            "name": "cfg",
            "configMap": {
                "name": "ckpt-config",
                "items": [{"key": "config.json", "path": "config.json"}],
            },
        },
        {
            "name": "podinfo",
            "downwardAPI": {
                "items": [
                    {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}
                ]
            },
        },
        {"name": "data", "persistentVolumeClaim": {"claimName": "ckpt-data"}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
    ]
    cluster.kubectl(
        "create", "-n", namespace, "-f", "-", input=_pod("trainer", [container], volumes)
    )

    with LocalPod(cluster, namespace, "trainer", timeout=60) as lp:
        seen_file = lp.local_path("/out/seen.json")
        cluster.wait_for(seen_file.exists, timeout=30, what="program started")
        seen = json.loads(seen_file.read_text())

        assert seen["env"]["POD_NAME"] == "trainer"
        # the node it was bound to (the shared cluster may hold other tests' nodes too)
        bound = cluster.get_json("pod", "trainer", "-n", namespace)["spec"]["nodeName"]
        assert bound and seen["env"]["NODE"] == bound
        assert seen["env"]["S3_KEY"] == "s3cr3t"
        assert seen["env"]["MODE"] == "fast"
        assert seen["env"]["mode"] == "fast"  # envFrom
        assert seen["env"]["DERIVED"] == "trainer-$(x)"
        assert seen["env"]["STORAGE"] == f"file://{data_dir}/run-1"
        assert json.loads(seen["env"]["CKPT_E2E_PATH_MAP"])["/ckpt"] == str(data_dir)
        assert seen["argv"] == [f"--storage={data_dir}/run-1", "fast"]
        assert seen["cwd"] == str(lp.local_path("/workspace"))
        # config file content is translated too
        assert seen["config"]["storage"] == f"{data_dir}/run-1"
        assert seen["config"]["shm"].startswith("/dev/shm/ckpt-e2e-")
        (data_dir / "run-1").mkdir(exist_ok=True)

        # A live annotation change reaches the downward-API file while the process runs.
        time.sleep(1.0)
        assert lp.running
        cluster.kubectl(
            "annotate", "pod", "trainer", "-n", namespace, "--overwrite", "ckpt.dev/save-now=req-7"
        )
        assert lp.wait(60) == 0

    assert (data_dir / "run-1" / "saved").read_text() == "req-7"
    pod = cluster.get_json("pod", "trainer", "-n", namespace)
    assert pod["status"]["phase"] == "Succeeded"
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"


def test_local_pod_deletion_sends_sigterm(cluster: LocalCluster, namespace: str) -> None:
    container = {
        "name": "main",
        "image": "none",
        "command": ["python3", "-c", SIGTERM_PROGRAM],
        "env": [{"name": "MARK", "value": "/out/mark"}],
        "volumeMounts": [{"name": "out", "mountPath": "/out"}],
    }
    volumes = [{"name": "out", "emptyDir": {}}]
    cluster.kubectl(
        "create", "-n", namespace, "-f", "-", input=_pod("victim", [container], volumes)
    )
    lp = LocalPod(cluster, namespace, "victim", timeout=60).start()
    try:
        cluster.wait_for(lp.local_path("/out/mark.started").exists, timeout=30, what="started")
        pod = cluster.get_json("pod", "victim", "-n", namespace)
        assert pod["metadata"]["annotations"]["e2e.ckpt.dev/local-process"] == str(lp.pid)
        cluster.kubectl("delete", "pod", "victim", "-n", namespace, "--wait=false")
        assert lp.wait(30) == 0
        assert lp.terminated_by_deletion
        assert lp.local_path("/out/mark").read_text() == "got SIGTERM"
    finally:
        lp.stop()

    # With the process gone, kwok finishes the deletion.
    cluster.wait_for(
        lambda: (
            cluster.kubectl("get", "pod", "victim", "-n", namespace, check=False).returncode != 0
        ),
        timeout=30,
        what="pod victim deleted",
    )


def test_sigkill_reports_137(cluster: LocalCluster, namespace: str) -> None:
    container = {"name": "pytorch", "image": "none", "command": ["sleep", "60"]}
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=_pod("crash", [container], []))
    with LocalPod(cluster, namespace, "crash", timeout=60) as lp:
        time.sleep(0.5)
        lp.signal(signal.SIGKILL)
        assert lp.wait(30) == 137
    pod = cluster.get_json("pod", "crash", "-n", namespace)
    assert pod["status"]["phase"] == "Failed"
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137


# Main process + a child in its process group (records a SIGTERM) + a helper that left
# the group (start_new_session, like a persister meant to outlive a trainer crash).
CONTAINER_PROGRAM = r"""
import os, pathlib, signal, subprocess, sys, time
out = pathlib.Path(os.environ["OUT"])
child_code = (
    "import pathlib, signal, sys, time\n"
    "def t(*_):\n"
    "    pathlib.Path(sys.argv[1]).write_text('child got SIGTERM')\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, t)\n"
    "time.sleep(300)\n"
)
child = subprocess.Popen([sys.executable, "-c", child_code, str(out / "child-term")])
helper = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True
)
def term(*_):
    (out / "main-term").write_text("1")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
(out / "pids").write_text(f"{child.pid} {helper.pid}")
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_deletion_signals_the_main_process_and_nothing_outlives_the_container(
    cluster: LocalCluster, namespace: str
) -> None:
    container = {
        "name": "main",
        "image": "none",
        "command": ["python3", "-c", CONTAINER_PROGRAM],
        "env": [{"name": "OUT", "value": "/out"}],
        "volumeMounts": [{"name": "out", "mountPath": "/out"}],
    }
    cluster.kubectl(
        "create",
        "-n",
        namespace,
        "-f",
        "-",
        input=_pod("box", [container], [{"name": "out", "emptyDir": {}}]),
    )
    lp = LocalPod(cluster, namespace, "box", timeout=60).start()
    try:
        pids_file = lp.local_path("/out/pids")
        cluster.wait_for(pids_file.exists, timeout=30, what="helpers started")
        child, helper = (int(p) for p in pids_file.read_text().split())
        assert _alive(child) and _alive(helper)
        cluster.kubectl("delete", "pod", "box", "-n", namespace, "--wait=false")
        assert lp.wait(30) == 0
        # like a container runtime: SIGTERM to the main process only ...
        assert lp.local_path("/out/main-term").exists()
        assert not lp.local_path("/out/child-term").exists()
        # ... and when it is gone, nothing it started survives (helper included)
        assert not _alive(child) and not _alive(helper)
    finally:
        lp.stop()


def test_select_container_native_sidecars_only() -> None:
    spec = {
        "containers": [{"name": "pytorch"}],
        "initContainers": [{"name": "setup"}, {"name": "agent", "restartPolicy": "Always"}],
    }
    pod = {"metadata": {"namespace": "ns", "name": "p"}, "spec": spec}
    assert select_container(pod, None)["name"] == "pytorch"
    assert select_container(pod, "agent")["restartPolicy"] == "Always"
    assert native_sidecars(pod) == ["agent"]
    with pytest.raises(LocalPodError, match="not a native sidecar"):
        select_container(pod, "setup")
    with pytest.raises(LocalPodError, match="no container 'x'"):
        select_container(pod, "x")


# A native sidecar: answers the main container through the pod's memory emptyDir, then
# waits for its SIGTERM (the pod ending).
SIDECAR_PROGRAM = r"""
import os, pathlib, signal, sys, time
shm = pathlib.Path(os.environ["SHM"])
def term(*_):
    (shm / "sidecar-term").write_text("1")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
deadline = time.time() + 60
while not (shm / "hello").exists() and time.time() < deadline:
    time.sleep(0.05)
(shm / "ack").write_text((shm / "hello").read_text())
time.sleep(120)
sys.exit(7)
"""

MAIN_PROGRAM = r"""
import os, pathlib, sys, time
shm = pathlib.Path(os.environ["SHM"])
(shm / "hello").write_text(str(os.getpid()))
deadline = time.time() + 60
while not (shm / "ack").exists() and time.time() < deadline:
    time.sleep(0.05)
sys.exit(0 if (shm / "ack").read_text() == str(os.getpid()) else 4)
"""


def test_native_sidecar_shares_the_pods_volumes_and_ends_with_the_pod(
    cluster: LocalCluster, namespace: str
) -> None:
    mounts = [{"name": "shm", "mountPath": "/shm"}]
    env = [{"name": "SHM", "value": "/shm"}]
    main = {"name": "pytorch", "image": "none", "command": ["python3", "-c", MAIN_PROGRAM]}
    side = {"name": "agent", "image": "none", "command": ["python3", "-c", SIDECAR_PROGRAM]}
    manifest = json.loads(
        _pod(
            "duo",
            [{**main, "env": env, "volumeMounts": mounts}],
            [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
        )
    )
    manifest["spec"]["initContainers"] = [
        {**side, "restartPolicy": "Always", "env": env, "volumeMounts": mounts}
    ]
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest))
    sidecar = LocalPod(cluster, namespace, "duo", container="agent", timeout=60).start()
    trainer = LocalPod(cluster, namespace, "duo", timeout=60).start()
    try:
        shm = trainer.local_path("/shm")
        assert sidecar.is_sidecar and shm == sidecar.local_path("/shm")
        assert trainer.wait(60) == 0, trainer.log_text()  # it saw the sidecar's answer
        pod = cluster.get_json("pod", "duo", "-n", namespace)
        assert pod["metadata"]["annotations"]["e2e.ckpt.dev/local-process"] == str(sidecar.pid)
        # the pod Succeeded: the kubelet ends its sidecar (SIGTERM), reported as an init
        # container's status, the pod's phase untouched
        assert sidecar.wait(30) == 0, sidecar.log_text()
        assert sidecar.terminated_with_pod and (shm / "sidecar-term").exists()
        pod = cluster.get_json("pod", "duo", "-n", namespace)
        assert pod["status"]["phase"] == "Succeeded"
        [status] = pod["status"]["initContainerStatuses"]
        assert status["name"] == "agent" and status["state"]["terminated"]["exitCode"] == 0
        assert "e2e.ckpt.dev/local-process" not in pod["metadata"].get("annotations", {})
        trainer.stop()
        assert shm.is_dir()  # the sidecar's LocalPod still holds the pod's volumes
    finally:
        trainer.stop()
        sidecar.stop()
    assert not shm.exists()

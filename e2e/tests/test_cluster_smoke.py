"""Smoke test of the local control plane: real API server, kwok node, training-operator,
and a PyTorchJob pod whose container runs as a local process."""

from __future__ import annotations

import base64
import http.server
import json
import pathlib
import ssl
import threading
from typing import Any, ClassVar

import pytest

from ckpt_e2e import LocalCluster, run_pod_locally

pytestmark = pytest.mark.e2e

PYTORCHJOB = """
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata:
  name: smoke
spec:
  # No runPolicy.backoffLimit: with one set, training-operator v1.7 deletes the failed pods
  # (ignoring cleanPodPolicy None) before it marks the job Failed.
  pytorchReplicaSpecs:
    Master:
      replicas: 1
      restartPolicy: Never
      template:
        spec:
          containers:
          - name: pytorch
            image: ckpt-e2e.invalid/never-pulled:0
            command: ["python", "-c", "import sys; sys.exit(3)"]
"""


def _condition(obj: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for c in obj.get("status", {}).get("conditions") or []:
        if c.get("type") == ctype:
            return dict(c)
    return None


def test_control_plane_is_up(cluster: LocalCluster, namespace: str) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.34.4"
    assert version["clientVersion"]["gitVersion"] == "v1.34.4"

    ns = cluster.get_json("namespace", namespace)
    assert ns["status"]["phase"] == "Active"

    # The cluster is shared: other tests add nodes of their own (a tainted loopback node,
    # pools) and remove them again (node-loss scenarios), so this checks the node the
    # fixture made and that every node is kwok's: not that the cluster has exactly one, nor
    # that every node a test ever made is still there (a shuffled order ran those first).
    names = [n["metadata"]["name"] for n in cluster.get_json("nodes")["items"]]
    assert "kwok-node-0" in names, names
    for other in names:
        annotations = cluster.get_json("node", other)["metadata"].get("annotations") or {}
        assert annotations.get("kwok.x-k8s.io/node") == "fake", (other, annotations)
    node = cluster.get_json("node", "kwok-node-0")
    ready = _condition(node, "Ready")
    assert ready is not None and ready["status"] == "True"
    assert node["status"]["nodeInfo"]["kubeletVersion"].startswith("kwok-")

    crd = cluster.get_json("crd", "pytorchjobs.kubeflow.org")
    established = _condition(crd, "Established")
    assert established is not None and established["status"] == "True"

    # RBAC is on: an unprivileged service account may not list pods cluster-wide ...
    sa = f"system:serviceaccount:{namespace}:default"
    can = cluster.kubectl("auth", "can-i", "list", "pods", "-A", f"--as={sa}", check=False)
    assert can.stdout.strip() == "no"
    # ... and the admission webhooks are enabled.
    plugins = cluster.procs["kube-apiserver"].argv
    assert any("MutatingAdmissionWebhook,ValidatingAdmissionWebhook" in a for a in plugins)
    webhooks = cluster.kubectl("api-resources", "--api-group=admissionregistration.k8s.io")
    assert "mutatingwebhookconfigurations" in webhooks.stdout

    # Service-account tokens are signed with the harness's key and accepted back.
    token = cluster.kubectl("create", "token", "default", "-n", namespace).stdout.strip()
    review = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "spec": {"token": token},
    }
    status = cluster.request("POST", "/apis/authentication.k8s.io/v1/tokenreviews", review)
    assert status["status"]["authenticated"] is True
    assert status["status"]["user"]["username"] == sa


def test_namespace_deletion_empties_it(cluster: LocalCluster) -> None:
    ns = cluster.create_namespace("e2e-ns-deletion")
    cluster.kubectl("create", "configmap", "x", "-n", ns, "--from-literal=a=b")
    cluster.delete_namespace(ns, wait=True, timeout=90)
    res = cluster.kubectl("get", "namespace", ns, check=False)
    assert res.returncode != 0 and "NotFound" in res.stderr


def test_pytorchjob_pod_runs_locally_and_job_fails(cluster: LocalCluster, namespace: str) -> None:
    cluster.apply(PYTORCHJOB, namespace=namespace)

    # The training-operator creates the master pod; the scheduler binds it to the kwok
    # node; kwok marks it Running.
    def pod_running() -> dict[str, Any] | None:
        pod = cluster.get_json("pod", "smoke-master-0", "-n", namespace)
        return pod if pod.get("status", {}).get("phase") == "Running" else None

    pod = cluster.wait_for(pod_running, timeout=60, what="smoke-master-0 Running")
    owner = pod["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("PyTorchJob", "smoke")
    # the scheduler may pick any untainted node other tests added to the shared cluster
    bound = cluster.get_json("node", pod["spec"]["nodeName"])
    assert bound["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    assert pod["metadata"]["labels"]["training.kubeflow.org/replica-type"] == "master"

    lp = run_pod_locally(cluster, namespace, "smoke-master-0", timeout=60)
    assert lp.exit_code == 3
    # The environment came from the pod as stored: the training-operator's injections.
    assert lp.env["RANK"] == "0"
    assert lp.env["WORLD_SIZE"] == "1"
    assert lp.env["MASTER_PORT"] == "23456"

    pod = cluster.get_json("pod", "smoke-master-0", "-n", namespace)
    assert pod["status"]["phase"] == "Failed"
    (cs,) = [c for c in pod["status"]["containerStatuses"] if c["name"] == "pytorch"]
    assert cs["state"]["terminated"]["exitCode"] == 3
    assert cs["state"]["terminated"]["reason"] == "Error"
    assert "e2e.ckpt.dev/local-process" not in pod["metadata"].get("annotations", {})

    def job_failed() -> dict[str, Any] | None:
        job = cluster.get_json("pytorchjob", "smoke", "-n", namespace)
        cond = _condition(job, "Failed")
        return job if cond is not None and cond["status"] == "True" else None

    job = cluster.wait_for(job_failed, timeout=60, what="PyTorchJob smoke Failed")
    succeeded = _condition(job, "Succeeded")
    assert succeeded is None or succeeded["status"] != "True"
    assert job["status"]["replicaStatuses"]["Master"].get("failed") == 1

    # Garbage collection (controller-manager) removes the job's pod and service.
    cluster.kubectl("delete", "pytorchjob", "smoke", "-n", namespace, "--wait=true")
    cluster.wait_for(
        lambda: not cluster.get_json("pods,services", "-n", namespace)["items"],
        timeout=60,
        what="pod and service of the deleted PyTorchJob garbage-collected",
    )


def test_helm_installs_a_chart(
    cluster: LocalCluster, namespace: str, tmp_path: pathlib.Path
) -> None:
    version = cluster.helm("version", "--short").stdout.strip()
    assert version.startswith("v3.19.5")
    chart = tmp_path / "tiny"
    (chart / "templates").mkdir(parents=True)
    # kubeVersion is checked against the server's stamped version (v1.34.4).
    (chart / "Chart.yaml").write_text(
        "apiVersion: v2\nname: tiny\nversion: 0.1.0\nkubeVersion: '>=1.30.0-0'\n"
    )
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\n"
        "data:\n  kube: {{ .Capabilities.KubeVersion.Version | quote }}\n"
    )
    cluster.helm("install", "r1", str(chart), "-n", namespace, "--wait", "--timeout=60s")
    cm = cluster.get_json("configmap", "r1-cm", "-n", namespace)
    assert cm["data"]["kube"] == "v1.34.4"
    releases = json.loads(cluster.helm("list", "-n", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("r1", "deployed")]
    cluster.helm("uninstall", "r1", "-n", namespace, "--wait")
    gone = cluster.kubectl("get", "configmap", "r1-cm", "-n", namespace, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr


class _DenyLabelled(http.server.BaseHTTPRequestHandler):
    """A validating webhook: denies objects labelled deny=yes."""

    calls: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        req = review["request"]
        self.calls.append(f"{req['operation']} {req['kind']['kind']} {req['name']}")
        labels = (req.get("object") or {}).get("metadata", {}).get("labels") or {}
        allowed = labels.get("deny") != "yes"
        body = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {
                "uid": req["uid"],
                "allowed": allowed,
                "status": {"code": 403, "message": "spec.deny: labelled deny=yes"},
            },
        }
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_admission_webhook_reaches_local_server(cluster: LocalCluster, namespace: str) -> None:
    assert cluster.ca is not None
    pair = cluster.ca.serving_cert("smoke-webhook", ["127.0.0.1", "localhost"])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _DenyLabelled)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(pair.cert), str(pair.key))
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    name = f"deny-{namespace}"
    try:
        webhook = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [
                {
                    "name": "deny.smoke.e2e.ckpt.dev",
                    "clientConfig": {
                        "url": f"https://127.0.0.1:{port}/validate",
                        "caBundle": base64.b64encode(cluster.ca.cert_pem).decode(),
                    },
                    "rules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE"],
                            "resources": ["configmaps"],
                        }
                    ],
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": namespace}
                    },
                    "sideEffects": "None",
                    "admissionReviewVersions": ["v1"],
                    "failurePolicy": "Fail",
                    "timeoutSeconds": 5,
                }
            ],
        }
        cluster.apply(webhook)

        def unlabelled_denied() -> bool:
            res = cluster.kubectl(
                "create",
                "configmap",
                "bad",
                "-n",
                namespace,
                "--dry-run=server",
                "-o",
                "name",
                "--from-literal=a=b",
                check=False,
            )
            return res.returncode != 0 and "labelled deny=yes" in res.stderr

        cm = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "bad", "labels": {"deny": "yes"}},
        }
        res = None

        def denied_labelled() -> bool:
            nonlocal res
            res = cluster.kubectl(
                "create", "-n", namespace, "-f", "-", input=json.dumps(cm), check=False
            )
            return res.returncode != 0 and "labelled deny=yes" in res.stderr

        # The configuration takes effect asynchronously: retry until the webhook is called.
        cluster.wait_for(denied_labelled, timeout=30, what="webhook denies a labelled ConfigMap")
        assert res is not None and "admission webhook" in res.stderr
        assert not unlabelled_denied()  # an unlabelled one is allowed (server dry-run)
        cluster.kubectl("create", "configmap", "good", "-n", namespace, "--from-literal=a=b")
        assert any(c == "CREATE ConfigMap good" for c in _DenyLabelled.calls)
    finally:
        cluster.kubectl("delete", "validatingwebhookconfiguration", name, "--ignore-not-found")
        server.shutdown()
        server.server_close()

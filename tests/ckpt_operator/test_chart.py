"""The Helm chart: `helm lint`, `helm template`, and the rendered objects that matter.

Needs the `helm` binary: ``$HELM``, ``helm`` on PATH, or the one built by
``e2e/build-tools.sh helm`` (``$CKPT_TOOLS_CACHE``, default
``~/.cache/ckpt-operator/tools/helm-*/helm``). The tests skip, saying so, only
when none exists; the project's test command builds it first.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509

from ckpt_operator.model import constants as c
from ckpt_operator.model.config import IdentityGrant, LocalPathGrant, TenancyConfig, parse_config
from ckpt_operator.planners.validation import CHECKED_ANNOTATIONS

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ckpt-operator"
NS = "ckpt-system"
RELEASE = "ckpt"


def find_helm() -> str | None:
    explicit = os.environ.get("HELM")
    if explicit:
        return explicit
    on_path = shutil.which("helm")
    if on_path:
        return on_path
    cache = Path(os.environ.get("CKPT_TOOLS_CACHE", Path.home() / ".cache/ckpt-operator/tools"))
    built = sorted(
        (
            p / "helm"
            for p in cache.glob("helm-*")
            if (p / ".complete").exists() and (p / "helm").exists()
        ),
        key=lambda p: p.stat().st_mtime,
    )
    return str(built[-1]) if built else None


HELM = find_helm()
pytestmark = pytest.mark.skipif(
    HELM is None,
    reason="helm binary not found ($HELM, PATH, or e2e/build-tools.sh helm): chart not checked",
)


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    env = {
        **os.environ,
        "HELM_CACHE_HOME": "/tmp/ckpt-helm/cache",
        "HELM_CONFIG_HOME": "/tmp/ckpt-helm/config",
        "HELM_DATA_HOME": "/tmp/ckpt-helm/data",
    }
    return subprocess.run(
        [HELM, *args], check=False, capture_output=True, text=True, env=env, timeout=120
    )


Rendered = dict[tuple[str, str], dict[str, Any]]


def render(*sets: str) -> Rendered:
    args = ["template", RELEASE, str(CHART), "--namespace", NS]
    for s in sets:
        args += ["--set", s]
    out = helm(*args)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    objs: Rendered = {}
    for d in docs:
        key = (d["kind"], d["metadata"]["name"])
        assert key not in objs, f"duplicate {key}"
        objs[key] = d
    return objs


@pytest.fixture(scope="module")
def default() -> Rendered:
    return render()


def only(objs: Rendered, kind: str) -> dict[str, Any]:
    found = [o for (k, _), o in objs.items() if k == kind]
    assert len(found) == 1, f"{kind}: {len(found)} objects"
    return found[0]


def kinds(objs: Rendered) -> set[str]:
    return {k for k, _ in objs}


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("webhook.certificate.source=certManager",),
        (
            "webhook.certificate.source=secret",
            "webhook.certificate.secret.name=my-tls",
            "webhook.certificate.secret.caBundle=Zm9v",
        ),
        (
            "metrics.serviceMonitor.enabled=true",
            "metrics.prometheusRule.enabled=true",
            "dashboard.enabled=true",
        ),
        ("webhook.enabled=false", "rbac.readStorageSecrets=false", "crds.enabled=false"),
    ],
    ids=["default", "cert-manager", "own-secret", "monitoring", "minimal"],
)
def test_lint(sets: tuple[str, ...]) -> None:
    args = ["lint", str(CHART), "--strict", "--namespace", NS]
    for s in sets:
        args += ["--set", s]
    out = helm(*args)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


def test_default_render_has_the_expected_objects(default: Rendered) -> None:
    assert kinds(default) == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "Service",
        "Secret",
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
        "CustomResourceDefinition",
    }
    for obj in default.values():
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "ckpt-operator"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["helm.sh/chart"] == "ckpt-operator-0.1.0"


def test_deployment_is_hardened(default: Rendered) -> None:
    dep = only(default, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    (ctr,) = pod["containers"]
    sc = ctr["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert ctr["resources"]["requests"]["cpu"] and ctr["resources"]["requests"]["memory"]
    assert ctr["resources"]["limits"]["memory"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert ctr[probe]["httpGet"] == {"path": "/healthz", "port": "probes"}
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    assert ports == {"probes": 8080, "metrics": 9090, "webhook": 9443}
    assert "--liveness=http://0.0.0.0:8080/healthz" in ctr["args"]
    assert "--webhook-cert-dir=/etc/ckpt-operator/tls" in ctr["args"]
    assert "--agent-image=ghcr.io/ckpt-operator/ckpt-agent:0.1.0" in ctr["args"]
    assert ctr["image"] == "ghcr.io/ckpt-operator/ckpt-operator:0.1.0"
    mounts = {m["name"]: m["mountPath"] for m in ctr["volumeMounts"]}
    assert mounts == {"tmp": "/tmp", "webhook-tls": "/etc/ckpt-operator/tls"}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["webhook-tls"]["secret"]["secretName"] == "ckpt-ckpt-operator-webhook-tls"
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert pod["serviceAccountName"] == "ckpt-ckpt-operator"


def rules(objs: Rendered) -> set[tuple[str, str, tuple[str, ...]]]:
    role = only(objs, "ClusterRole")
    out = set()
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out.add((group, res, tuple(sorted(rule["verbs"]))))
    return out


def test_rbac_is_least_privilege(default: Rendered) -> None:
    assert rules(default) == {
        ("kubeflow.org", "pytorchjobs", ("create", "get", "list", "patch", "watch")),
        # Kubeflow Trainer v2 (issue #15): TrainJobs as PyTorchJobs; the label-trainjob
        # webhook reads the runtime; JobSets are watched for their restart attempt
        ("trainer.kubeflow.org", "trainjobs", ("create", "get", "list", "patch", "watch")),
        ("trainer.kubeflow.org", "clustertrainingruntimes", ("get",)),
        ("trainer.kubeflow.org", "trainingruntimes", ("get",)),
        ("jobset.x-k8s.io", "jobsets", ("get", "list", "watch")),
        ("ckpt.dev", "checkpointpolicies", ("get", "list", "patch", "watch")),
        ("ckpt.dev", "checkpointpolicies/status", ("get", "patch")),
        ("", "pods", ("get", "list", "patch", "watch")),
        ("", "nodes", ("get", "list", "watch")),
        ("", "configmaps", ("create", "get", "patch")),
        ("", "events", ("create",)),
        ("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch")),
        ("", "secrets", ("get",)),
    }
    text = json.dumps(only(default, "ClusterRole"))
    assert '"*"' not in text
    for verb in ("delete", "deletecollection", "update", "escalate", "bind", "impersonate"):
        assert f'"{verb}"' not in text
    binding = only(default, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == "ckpt-ckpt-operator"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "ckpt-ckpt-operator", "namespace": NS}
    ]


def test_rbac_options() -> None:
    objs = render("rbac.readStorageSecrets=false", "watchNamespaces.team-a=true")
    granted = {(g, r) for g, r, _ in rules(objs)}
    assert ("", "secrets") not in granted and ("", "namespaces") in granted
    args = only(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--read-storage-secrets=false" in args


def test_issuing_replica_secrets_grants_create_bounded_by_an_admission_policy(
    default: Rendered,
) -> None:
    """rbac.issueReplicaSecrets (off by default): `create` on Secrets, which RBAC cannot
    narrow, bounded by a ValidatingAdmissionPolicy on the operator's own account (the real
    API server enforces it: e2e/tests/test_replica_secrets.py)."""
    args = only(default, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--issue-replica-secrets=false" in args
    assert "ValidatingAdmissionPolicy" not in kinds(default)
    objs = render("rbac.issueReplicaSecrets=true")
    assert ("", "secrets", ("create",)) in rules(objs)
    args = only(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--issue-replica-secrets=true" in args
    policy = only(objs, "ValidatingAdmissionPolicy")
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert (rule["resources"], rule["operations"]) == (["secrets"], ["CREATE"])
    (cond,) = policy["spec"]["matchConditions"]
    assert f"'system:serviceaccount:{NS}:ckpt-ckpt-operator'" in cond["expression"]
    checks = " ".join(v["expression"] for v in policy["spec"]["validations"])
    for needle in ("'Opaque'", "startsWith('ckpt-replica-')", "'issued'", "service-account.name"):
        assert needle in checks
    binding = only(objs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "ValidatingAdmissionPolicy" not in kinds(
        render("rbac.issueReplicaSecrets=true", "rbac.create=false")
    )


def test_the_replica_rack_label_reaches_the_operator_and_its_rights_suffice(
    default: Rendered,
) -> None:
    """operator.replicaRackLabel (unset by default) becomes --replica-rack-label; the peer
    map needs no right beyond the ConfigMaps and nodes the operator already has."""
    args = only(default, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--replica-rack-label") for a in args)
    objs = render("operator.replicaRackLabel=topology.example.com/rack")
    args = only(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--replica-rack-label=topology.example.com/rack" in args
    granted = rules(default)
    assert ("", "configmaps", ("create", "get", "patch")) in granted
    assert ("", "nodes", ("get", "list", "watch")) in granted
    bad = helm("template", RELEASE, str(CHART), "--set", "operator.replicaRackLabel=a b")
    assert bad.returncode != 0 and "replicaRackLabel" in bad.stderr


def test_webhooks_point_at_the_operator_with_a_trusted_ca(default: Rendered) -> None:
    mutating = only(default, "MutatingWebhookConfiguration")
    hook, lhook, thook = mutating["webhooks"]
    # fails closed for opted-in pods, and only they call it (issue #19)
    assert hook["name"] == "inject.pods.ckpt.dev"
    assert hook["failurePolicy"] == "Fail"
    assert hook["sideEffects"] == "NoneOnDryRun"
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["timeoutSeconds"] == 5
    assert hook["rules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods"],
            "operations": ["CREATE"],
            "scope": "Namespaced",
        }
    ]
    assert hook["objectSelector"] == {"matchLabels": {c.LABEL_INJECT: "true"}}
    # the job webhook puts that label on opted-in jobs' pod templates; other jobs never call it
    assert lhook["name"] == "label.pytorchjobs.ckpt.dev"
    assert lhook["failurePolicy"] == "Fail" and lhook["sideEffects"] == "None"
    assert lhook["clientConfig"]["service"]["path"] == f"/{c.WEBHOOK_LABEL_JOB_ID}"
    assert lhook["rules"][0]["resources"] == ["pytorchjobs"]
    assert lhook["rules"][0]["operations"] == ["CREATE"]
    cond, unlabelled = lhook["matchConditions"]
    assert f"'{c.ANN_POLICY}' in object.metadata.annotations" in cond["expression"]
    # nor jobs whose pod templates are all labelled already: the operator's restarts
    assert unlabelled["name"] == "a-template-unlabelled"
    assert f"labels['{c.LABEL_INJECT}'] != 'true'" in unlabelled["expression"]
    assert lhook["clientConfig"]["caBundle"] == hook["clientConfig"]["caBundle"]
    # TrainJobs: the operator's runtime patch labels their trainer pods (issue #15)
    assert thook["name"] == "label.trainjobs.ckpt.dev"
    assert thook["failurePolicy"] == "Fail" and thook["sideEffects"] == "None"
    assert thook["clientConfig"]["service"]["path"] == f"/{c.WEBHOOK_LABEL_TRAINJOB_ID}"
    assert thook["rules"][0]["apiGroups"] == [c.TRAINJOB_GROUP]
    assert thook["rules"][0]["resources"] == ["trainjobs"]
    assert thook["rules"][0]["operations"] == ["CREATE"]
    assert thook["matchConditions"] == [cond]
    assert thook["clientConfig"]["caBundle"] == hook["clientConfig"]["caBundle"]
    (expr,) = hook["namespaceSelector"]["matchExpressions"]
    assert expr["operator"] == "NotIn" and "kube-system" in expr["values"]
    svc = hook["clientConfig"]["service"]
    assert svc == {
        "name": "ckpt-ckpt-operator-webhook",
        "namespace": NS,
        "path": f"/{c.WEBHOOK_INJECT_ID}",
        "port": 443,
    }

    validating = only(default, "ValidatingWebhookConfiguration")
    vhook, jhook, tvhook = validating["webhooks"]
    assert vhook["name"] == "validate.checkpointpolicies.ckpt.dev"
    assert jhook["name"] == "validate.pytorchjobs.ckpt.dev"
    assert jhook["failurePolicy"] == "Ignore" and jhook["sideEffects"] == "None"
    assert jhook["clientConfig"]["service"]["path"] == f"/{c.WEBHOOK_VALIDATE_JOB_ID}"
    assert jhook["rules"][0]["resources"] == ["pytorchjobs"]
    assert jhook["clientConfig"]["caBundle"] == vhook["clientConfig"]["caBundle"]
    assert tvhook["name"] == "validate.trainjobs.ckpt.dev"
    assert tvhook["failurePolicy"] == "Ignore"
    assert tvhook["clientConfig"]["service"]["path"] == f"/{c.WEBHOOK_VALIDATE_TRAINJOB_ID}"
    assert tvhook["rules"][0]["resources"] == ["trainjobs"]
    assert set(tvhook["rules"][0]["operations"]) == {"CREATE", "UPDATE"}
    assert vhook["failurePolicy"] == "Fail" and vhook["sideEffects"] == "None"
    assert vhook["clientConfig"]["service"]["path"] == f"/{c.WEBHOOK_VALIDATE_ID}"
    assert vhook["rules"][0]["resources"] == ["checkpointpolicies"]
    assert set(vhook["rules"][0]["operations"]) == {"CREATE", "UPDATE"}

    service = default[("Service", "ckpt-ckpt-operator-webhook")]
    assert service["spec"]["ports"] == [
        {"name": "https", "port": 443, "targetPort": "webhook", "protocol": "TCP"}
    ]
    # one CA for both configurations and the mounted Secret; the serving cert chains to it
    secret = only(default, "Secret")
    assert secret["type"] == "kubernetes.io/tls"
    assert (
        hook["clientConfig"]["caBundle"]
        == vhook["clientConfig"]["caBundle"]
        == secret["data"]["ca.crt"]
    )
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert f"ckpt-ckpt-operator-webhook.{NS}.svc" in sans.get_values_for_type(x509.DNSName)
    annotations = only(default, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert "checksum/webhook-cert" in annotations


def test_job_validation_is_called_only_when_a_checked_annotation_changes(
    default: Rendered,
) -> None:
    """Issue #19: the operator's own PATCHes and the training-operator's updates of a job
    skip the validation webhook; every write ``annotation_errors`` could refuse calls it
    (the condition, in Python: test_status_validation.py)."""
    _, jhook, tvhook = only(default, "ValidatingWebhookConfiguration")["webhooks"]
    (cond,) = jhook["matchConditions"]
    assert tvhook["matchConditions"] == jhook["matchConditions"]
    expr = " ".join(cond["expression"].split())
    listed = re.fullmatch(
        r"has\(object\.metadata\.annotations\) && \[(.*?)\]\.exists\(k, (.*)\)", expr
    )
    assert listed is not None, expr
    assert [k.strip().strip("'") for k in listed[1].split(",")] == list(CHECKED_ANNOTATIONS)
    assert listed[2] == (
        "k in object.metadata.annotations && (request.operation == 'CREATE' || "
        "!has(oldObject.metadata.annotations) || !(k in oldObject.metadata.annotations) || "
        "oldObject.metadata.annotations[k] != object.metadata.annotations[k])"
    )


@pytest.mark.parametrize(
    ("url", "san_type", "san"),
    [
        ("https://127.0.0.1:9443", x509.IPAddress, "127.0.0.1"),
        ("https://ckpt.example.org:8443/", x509.DNSName, "ckpt.example.org"),
    ],
)
def test_webhook_url_mode_for_an_operator_outside_the_cluster(
    url: str, san_type: type[x509.GeneralName], san: str
) -> None:
    objs = render(f"webhook.url={url}")
    base = url.rstrip("/")
    hook, lhook, thook = only(objs, "MutatingWebhookConfiguration")["webhooks"]
    vhook, jhook, tvhook = only(objs, "ValidatingWebhookConfiguration")["webhooks"]
    assert thook["clientConfig"]["url"] == f"{base}/{c.WEBHOOK_LABEL_TRAINJOB_ID}"
    assert tvhook["clientConfig"]["url"] == f"{base}/{c.WEBHOOK_VALIDATE_TRAINJOB_ID}"
    assert "service" not in hook["clientConfig"] and "service" not in vhook["clientConfig"]
    assert lhook["clientConfig"]["url"] == f"{base}/{c.WEBHOOK_LABEL_JOB_ID}"
    assert jhook["clientConfig"]["url"] == f"{base}/{c.WEBHOOK_VALIDATE_JOB_ID}"
    assert hook["clientConfig"]["url"] == f"{base}/{c.WEBHOOK_INJECT_ID}"
    assert vhook["clientConfig"]["url"] == f"{base}/{c.WEBHOOK_VALIDATE_ID}"
    secret = only(objs, "Secret")
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    values = [str(v) for v in sans.get_values_for_type(san_type)]
    assert san in values
    # the in-cluster names stay valid too
    assert f"ckpt-ckpt-operator-webhook.{NS}.svc" in sans.get_values_for_type(x509.DNSName)


def test_cert_manager_mode() -> None:
    objs = render("webhook.certificate.source=certManager")
    assert {"Certificate", "Issuer"} <= kinds(objs) and "Secret" not in kinds(objs)
    cert = only(objs, "Certificate")
    assert cert["spec"]["secretName"] == "ckpt-ckpt-operator-webhook-tls"
    assert f"ckpt-ckpt-operator-webhook.{NS}.svc" in cert["spec"]["dnsNames"]
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        conf = only(objs, kind)
        assert conf["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
            f"{NS}/ckpt-ckpt-operator-webhook"
        )
        assert "caBundle" not in conf["webhooks"][0]["clientConfig"]
    issuer_ref = render(
        "webhook.certificate.source=certManager",
        "webhook.certificate.certManager.issuerRef.name=corp-ca",
        "webhook.certificate.certManager.issuerRef.kind=ClusterIssuer",
    )
    assert "Issuer" not in kinds(issuer_ref)
    assert only(issuer_ref, "Certificate")["spec"]["issuerRef"] == {
        "name": "corp-ca",
        "kind": "ClusterIssuer",
    }


def test_own_secret_mode_requires_its_ca() -> None:
    out = helm(
        "template",
        RELEASE,
        str(CHART),
        "--set",
        "webhook.certificate.source=secret",
        "--set",
        "webhook.certificate.secret.name=my-tls",
    )
    assert out.returncode != 0 and "caBundle is required" in out.stderr


def test_crd_options(default: Rendered) -> None:
    crd = only(default, "CustomResourceDefinition")
    assert crd["metadata"]["name"] == "checkpointpolicies.ckpt.dev"
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert crd["metadata"]["labels"]["app.kubernetes.io/part-of"] == "ckpt-operator"
    assert (
        "annotations" not in only(render("crds.keep=false"), "CustomResourceDefinition")["metadata"]
    )
    assert "CustomResourceDefinition" not in kinds(render("crds.enabled=false"))


def test_monitoring_objects() -> None:
    objs = render(
        "metrics.serviceMonitor.enabled=true",
        "metrics.prometheusRule.enabled=true",
        "dashboard.enabled=true",
    )
    sm = only(objs, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    metrics_svc = objs[("Service", "ckpt-ckpt-operator-metrics")]
    assert (
        sm["spec"]["selector"]["matchLabels"].items() <= metrics_svc["metadata"]["labels"].items()
    )
    rule = only(objs, "PrometheusRule")["spec"]["groups"][0]["rules"][0]
    assert rule["alert"] == "CkptRecoverySuccessRateLow" and rule["for"] == "5m"
    assert 'ckpt_operator_recoveries_total{result="success"}' in rule["expr"]
    assert rule["expr"].strip().endswith("< 0.98")
    dash = only(objs, "ConfigMap")
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(dash["data"]["ckpt-operator.json"])
    exprs = " ".join(t["expr"] for p in board["panels"] for t in p["targets"])
    for metric in (
        "ckpt_operator_restarts_total",
        "ckpt_operator_failure_to_restart_seconds_bucket",
        "ckpt_operator_retention_deletions_total",
        "ckpt_operator_webhook_duration_seconds_bucket",
    ):
        assert metric in exprs


def test_webhook_disabled() -> None:
    objs = render("webhook.enabled=false")
    assert not {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration", "Secret"} & kinds(
        objs
    )
    args = only(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--webhook=false" in args


def test_maps_render_as_lists() -> None:
    objs = render(
        "storage.extraVolumes.ckpt.persistentVolumeClaim.claimName=ckpt-pvc",
        "storage.extraVolumeMounts.ckpt.mountPath=/var/lib/ckpt",
        "tolerations.gpu.key=nvidia.com/gpu",
        "tolerations.gpu.operator=Exists",
        "imagePullSecrets.regcred=true",
        "operator.extraEnv.AWS_REGION=eu-west-1",
    )
    pod = only(objs, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt-pvc"}} in pod["volumes"]
    assert {"name": "ckpt", "mountPath": "/var/lib/ckpt"} in pod["containers"][0]["volumeMounts"]
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert {"name": "AWS_REGION", "value": "eu-west-1"} in pod["containers"][0]["env"]


@pytest.mark.parametrize(
    "bad",
    [
        "webhook.inject.failurePolicy=Sometimes",
        "replicaCount=2",
        "operator.logFormat=xml",
        "webhook.certificate.source=vault",
        "webhook.url=http://127.0.0.1:9443",
        "unknownTopLevel=1",
        "tenancy.localPaths[0].path=relative",
        "tenancy.allowedS3Endpoints[0]=http://evil.example/path",
        "tenancy.operatorIdentity[0].namespace=team-a",
    ],
)
def test_schema_rejects_bad_values(bad: str) -> None:
    out = helm("template", RELEASE, str(CHART), "--set", bad)
    assert out.returncode != 0
    assert "values don't meet the specifications of the schema" in out.stderr


def _leaves(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        out: list[str] = []
        for key, value in node.items():
            out += _leaves(value, f"{prefix}{key}.")
        return out
    return [prefix.rstrip(".")]


def test_every_value_is_documented() -> None:
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(values) <= set(schema["properties"])
    documented = set(re.findall(r"^\s*# ([\w.]+) --", text, re.M))
    missing = []
    for leaf in _leaves(values):
        parts = leaf.split(".")
        if not any(".".join(parts[:n]) in documented for n in range(1, len(parts) + 1)):
            missing.append(leaf)
    assert missing == [], f"values.yaml: undocumented values {missing}"


def test_tenancy_values_reach_the_operator_config() -> None:
    """The chart's tenancy grants and storage timeouts become flags the operator parses."""
    objs = render(
        "tenancy.operatorIdentity[0].namespace=team-a",
        "tenancy.operatorIdentity[0].bucket=ckpt-team-a",
        "tenancy.operatorIdentity[0].prefix=runs",
        "tenancy.localPaths[0].namespace=*",
        "tenancy.localPaths[0].path=/mnt/ckpt",
        "tenancy.allowedS3Endpoints[0]=http://minio.storage.svc:9000",
        "operator.storageTimeoutSeconds=12",
    )
    args = only(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--storage-timeout=12" in args and "--verify-timeout=3600" in args
    cfg = parse_config([*args, "--webhook=false"], environ={})
    assert cfg.storage_timeout_s == 12.0
    assert cfg.tenancy == TenancyConfig(
        operator_identity=(IdentityGrant("team-a", "ckpt-team-a", "runs"),),
        local_paths=(LocalPathGrant("*", "/mnt/ckpt"),),
        allowed_s3_endpoints=("http://minio.storage.svc:9000",),
    )
    default_args = only(render(), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert parse_config([*default_args["args"], "--webhook=false"], environ={}).tenancy == (
        TenancyConfig()
    )


def test_inject_failure_policy_can_be_relaxed() -> None:
    hook, lhook, thook = only(
        render("webhook.inject.failurePolicy=Ignore", "webhook.labelJobs.failurePolicy=Ignore"),
        "MutatingWebhookConfiguration",
    )["webhooks"]
    assert hook["failurePolicy"] == lhook["failurePolicy"] == thook["failurePolicy"] == "Ignore"
    assert hook["objectSelector"] == {"matchLabels": {c.LABEL_INJECT: "true"}}


def test_worker_pools_and_budget_reach_the_operator_config() -> None:
    objs = render("operator.workers=32", "webhook.workers=2", "webhook.budgetSeconds=2")
    args = only(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    cfg = parse_config(
        [*(a for a in args if not a.startswith("--webhook-cert-dir")), "--webhook-generate-certs"],
        environ={},
    )
    assert cfg.workers == 32 and cfg.api_timeout_s == 30.0
    assert cfg.webhook.workers == 2 and cfg.webhook.budget_s == 2.0
    assert cfg.standalone


def test_peering_allows_more_replicas() -> None:
    objs = render("operator.peering=true", "replicaCount=2")
    deployment = only(objs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert "--peering" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    crd = objs[("CustomResourceDefinition", "clusterkopfpeerings.kopf.dev")]
    assert crd["spec"]["scope"] == "Cluster"
    rules = only(objs, "ClusterRole")["rules"]
    assert any("clusterkopfpeerings" in r["resources"] and "patch" in r["verbs"] for r in rules)
    # without peering: one replica, no peering objects or permissions
    assert ("CustomResourceDefinition", "clusterkopfpeerings.kopf.dev") not in render()
    assert (
        "--peering"
        not in only(render(), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    )


def test_kueue_is_off_by_default_and_on_grants_workloads(default: Rendered) -> None:
    """``kueue.enabled`` (#30): the operator's ``--kueue`` and RBAC on Kueue Workloads; off,
    neither (the least-privilege test above pins the default rules)."""
    args = only(default, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--kueue") for a in args)
    assert not any(g == "kueue.x-k8s.io" for g, _, _ in rules(default))
    objs = render("kueue.enabled=true")
    args = only(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    cfg = parse_config(
        [*(a for a in args if not a.startswith("--webhook-cert-dir")), "--webhook-generate-certs"],
        environ={},
    )
    assert cfg.kueue
    assert ("kueue.x-k8s.io", "workloads", ("get", "list", "patch", "watch")) in rules(objs)

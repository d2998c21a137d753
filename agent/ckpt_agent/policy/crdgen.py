"""Generate the ``CheckpointPolicy`` CRD from the pydantic models.

Usage::

    python -m ckpt_agent.policy.crdgen            # rewrite crds/ and the chart's copy
    python -m ckpt_agent.policy.crdgen --check    # exit 1 if the committed YAML drifted

The pydantic JSON schema is turned into a Kubernetes *structural* OpenAPI v3
schema: ``$ref`` inlined, ``Optional`` turned into ``nullable``, JSON-Schema
2020 numeric bounds turned into OpenAPI 3.0 ones, titles dropped, object-typed
fields defaulted to ``{}`` so the API server applies nested defaults, and the
models' CEL rules kept as ``x-kubernetes-validations``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from ckpt_agent.policy.models import (
    API_GROUP,
    API_VERSION,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    CheckpointPolicySpec,
    CheckpointPolicyStatus,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
CRD_PATH = REPO_ROOT / "crds" / f"{API_GROUP}_{PLURAL}.yaml"
CHART_CRD_PATH = REPO_ROOT / "charts" / "ckpt-operator" / "templates" / "crds" / f"{PLURAL}.yaml"

_DROP_KEYS = {"title", "$defs", "discriminator"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(x, defs) for x in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        target = copy.deepcopy(defs[name])
        rest = {k: v for k, v in node.items() if k != "$ref"}
        target.update(rest)  # keep description/default given at the use site
        return _resolve(target, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP_KEYS:
            continue
        if key == "properties":
            out[key] = {k: _resolve(v, defs) for k, v in value.items()}
        else:
            out[key] = _resolve(value, defs)
    return out


def _structural(node: Any) -> Any:
    """Rewrite JSON-Schema constructs the API server does not accept."""
    if isinstance(node, list):
        return [_structural(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _structural(v) for k, v in node.items()}
    any_of = node.get("anyOf")
    if isinstance(any_of, list):
        non_null = [s for s in any_of if s.get("type") != "null"]
        if len(non_null) == 1 and len(non_null) < len(any_of):
            merged = dict(non_null[0])
            for k, v in node.items():
                if k != "anyOf":
                    merged[k] = v
            merged["nullable"] = True
            if merged.get("default", "absent") is None:
                del merged["default"]
            node = merged
    if node.get("additionalProperties") is False:
        # Structural schemas forbid properties + additionalProperties together; unknown
        # fields are rejected by strict field validation (kubectl's default) instead.
        del node["additionalProperties"]
    elif node.get("additionalProperties") is True and "properties" in node:
        # extra="allow" models: keep unknown fields instead of pruning them.
        del node["additionalProperties"]
        node["x-kubernetes-preserve-unknown-fields"] = True
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node and not isinstance(node[bound], bool):
            node[plain] = node.pop(bound)
            node[bound] = True
    return node


def _with_nested_defaults(value: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """``value`` with the schema's nested defaults filled in (what the API server does)."""
    out = copy.deepcopy(value)
    for name, prop in schema.get("properties", {}).items():
        if name not in out and "default" in prop:
            out[name] = copy.deepcopy(prop["default"])
        if isinstance(out.get(name), dict) and "properties" in prop:
            out[name] = _with_nested_defaults(out[name], prop)
    return out


def _default_objects(node: dict[str, Any]) -> dict[str, Any]:
    """Give object-typed properties ``default: {}`` so nested defaults are applied.

    An object that carries CEL rules gets its defaults spelled out instead: the API
    server checks a CRD's default values against its CEL rules *without* applying the
    nested defaults first, so ``{}`` fails a rule like ``self.importantScore <=
    self.criticalScore`` ("no such key") and the CRD is rejected. Same resulting objects.
    """
    for prop in node.get("properties", {}).values():
        if prop.get("type") == "object" and "properties" in prop:
            _default_objects(prop)
            if not prop.get("nullable"):
                prop.setdefault("default", {})
                if prop.get("x-kubernetes-validations"):
                    prop["default"] = _with_nested_defaults(prop["default"], prop)
        elif prop.get("type") == "object" and isinstance(prop.get("additionalProperties"), dict):
            _default_objects(prop["additionalProperties"])
        elif prop.get("type") == "array" and isinstance(prop.get("items"), dict):
            _default_objects(prop["items"])
    return node


def openapi_schema(model: type[Any]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a pydantic model, as the CRD wants it."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    resolved = _resolve(raw, defs)
    schema: dict[str, Any] = _default_objects(_structural(resolved))
    return schema


def _status_schema() -> dict[str, Any]:
    schema = openapi_schema(CheckpointPolicyStatus)
    # The operator owns status and may add fields before the model learns them.
    schema["x-kubernetes-preserve-unknown-fields"] = True
    conditions = schema["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    conditions["items"].pop("additionalProperties", None)
    conditions["items"]["x-kubernetes-preserve-unknown-fields"] = True
    return schema


def build_crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition object."""
    spec_schema = openapi_schema(CheckpointPolicySpec)
    spec_schema["default"] = {}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{API_GROUP}",
            "annotations": {"ckpt.dev/generated-by": "python -m ckpt_agent.policy.crdgen"},
        },
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["ckpt"],
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": "Storage", "type": "string", "jsonPath": ".spec.storage.type"},
                        {
                            "name": "Auto-Resume",
                            "type": "boolean",
                            "jsonPath": ".spec.recovery.autoResume",
                        },
                        {"name": "Jobs", "type": "integer", "jsonPath": ".status.jobs"},
                        {
                            "name": "Checkpoints",
                            "type": "integer",
                            "jsonPath": ".status.validCheckpoints",
                        },
                        {
                            "name": "Ready",
                            "type": "string",
                            "jsonPath": ".status.conditions[?(@.type=='Ready')].status",
                        },
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "CheckpointPolicy configures adaptive, tiered "
                            "checkpointing and automatic recovery for the PyTorchJobs "
                            "that reference it with the ckpt.dev/policy annotation.",
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": _status_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }


HEADER = (
    "# Generated by `python -m ckpt_agent.policy.crdgen` from ckpt_agent/policy/models.py.\n"
    "# Do not edit by hand: a test fails when this file and the models disagree.\n"
)


def render_crd() -> str:
    return HEADER + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


def render_chart_crd() -> str:
    """The chart copy: templated so upgrades update it and `crds.keep` can protect it."""
    body = yaml.safe_dump(build_crd(), sort_keys=False, width=100)
    meta_line = "metadata:\n"
    assert body.count(meta_line) >= 1
    templated_meta = (
        "metadata:\n"
        "  labels:\n"
        '    {{- include "ckpt-operator.labels" . | nindent 4 }}\n'
        "  {{- if .Values.crds.keep }}\n"
        "  annotations:\n"
        "    helm.sh/resource-policy: keep\n"
        "  {{- end }}\n"
    )
    # Replace the generated metadata block (name + annotations) with the templated one.
    lines = body.splitlines(keepends=True)
    start = lines.index(meta_line)
    end = start + 1
    while end < len(lines) and lines[end].startswith("  "):
        end += 1
    name_line = f"  name: {PLURAL}.{API_GROUP}\n"
    new = templated_meta.replace("metadata:\n", "metadata:\n" + name_line, 1)
    body = "".join([*lines[:start], new, *lines[end:]])
    return "{{- if .Values.crds.enabled }}\n" + HEADER + body + "{{- end }}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ckpt_agent.policy.crdgen",
        description="Write the CheckpointPolicy CRD (crds/ and the Helm chart) from the models.",
    )
    parser.add_argument(
        "--check", action="store_true", help="fail if the committed files are out of date"
    )
    args = parser.parse_args(argv)
    targets = {CRD_PATH: render_crd(), CHART_CRD_PATH: render_chart_crd()}
    stale = [p for p, text in targets.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            rel = p.relative_to(REPO_ROOT)
            print(f"out of date: {rel} (run python -m ckpt_agent.policy.crdgen)")
        return 1 if stale else 0
    for p, text in targets.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        print(f"wrote {p.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

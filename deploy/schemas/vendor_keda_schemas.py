"""Regenerate the vendored KEDA JSON schemas from KEDA's CRD YAML.

Usage (from the repository root)::

    git clone --depth 1 --branch v2.20.2 https://github.com/kedacore/keda /tmp/keda
    python deploy/schemas/vendor_keda_schemas.py /tmp/keda/config/crd/bases --keda-version v2.20.2

Why not vendor the CRDs as they are:

* ``kubernetes-validate`` only warns on custom kinds, so ``.ci/static-checks.sh`` checks KEDA's
  objects with ``check-jsonschema`` against each CRD's ``openAPIV3Schema``.
* The API server prunes unknown fields of a structural schema, and ``kubectl apply`` (server-side
  field validation ``Strict``, the default since Kubernetes 1.27) rejects them. A plain JSON Schema
  validator would let a typo such as ``listname`` pass, so every closed object here gets
  ``additionalProperties: false`` (objects marked ``x-kubernetes-preserve-unknown-fields`` or with a
  schema for extra keys stay open).
* The ScaledJob CRD embeds a whole PodTemplateSpec (650 kB). It is replaced by a stub; the static
  checks validate ``jobTargetRef`` as a real ``batch/v1`` Job spec with kubernetes-validate instead.
* Descriptions are dropped: the files stay small and diffs stay readable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

CRDS = {
    "ScaledObject": "keda.sh_scaledobjects.yaml",
    "ScaledJob": "keda.sh_scaledjobs.yaml",
    "TriggerAuthentication": "keda.sh_triggerauthentications.yaml",
}
VERSION = "v1alpha1"
OUT_DIR = Path(__file__).resolve().parent

POD_TEMPLATE_STUB: dict[str, Any] = {
    "type": "object",
    "x-lmdq-note": "PodTemplateSpec: pruned here, validated by kubernetes-validate as a batch/v1 Job",
    "x-kubernetes-preserve-unknown-fields": True,
}


def _close(node: Any) -> Any:
    """Drop descriptions and close every object schema the API server would prune."""
    if isinstance(node, list):
        return [_close(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _close(v) for k, v in node.items() if k != "description"}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def extract(crd_path: Path, kind: str) -> dict[str, Any]:
    crd = yaml.safe_load(crd_path.read_text())
    if crd.get("kind") != "CustomResourceDefinition" or crd["spec"]["names"]["kind"] != kind:
        raise SystemExit(f"{crd_path}: not the CRD of {kind}")
    versions = {v["name"]: v for v in crd["spec"]["versions"]}
    if VERSION not in versions:
        raise SystemExit(f"{crd_path}: no {VERSION} version (have {sorted(versions)})")
    schema = versions[VERSION]["schema"]["openAPIV3Schema"]
    if kind == "ScaledJob":
        job_ref = schema["properties"]["spec"]["properties"]["jobTargetRef"]
        job_ref["properties"]["template"] = dict(POD_TEMPLATE_STUB)
    schema.get("properties", {}).pop("status", None)  # written by KEDA, never by us
    schema = _close(schema)
    # metadata is `type: object` in the CRD; keep it open but require the identity fields.
    schema["properties"]["apiVersion"] = {"const": f"{crd['spec']['group']}/{VERSION}"}
    schema["properties"]["kind"] = {"const": kind}
    schema["properties"]["metadata"] = {
        "type": "object",
        "required": ["name"],
        "properties": {"name": {"type": "string", "minLength": 1}},
    }
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
    return schema


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crd_dir", type=Path, help="KEDA's config/crd/bases directory")
    parser.add_argument("--keda-version", required=True, help="the KEDA tag the CRDs come from")
    args = parser.parse_args(argv)
    for kind, filename in CRDS.items():
        schema = extract(args.crd_dir / filename, kind)
        doc = {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "$comment": (
                f"KEDA {args.keda_version} {kind} {VERSION} openAPIV3Schema from config/crd/bases/{filename}, "
                "reduced by deploy/schemas/vendor_keda_schemas.py (closed objects, no descriptions)"
            ),
            **schema,
        }
        out = OUT_DIR / f"keda-{kind.lower()}-{VERSION}.json"
        out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"wrote {out.name} ({out.stat().st_size} B)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

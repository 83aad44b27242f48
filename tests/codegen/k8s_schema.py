"""A custom resource checked as the API server checks it with strict field validation
(`kubectl apply --validate=strict`): the CRD's own openAPIV3Schema (committed under data/, see
each file's _source) turned into a JSON Schema in which an unknown field is an error, except
where the schema keeps unknown fields (x-kubernetes-preserve-unknown-fields) or types a map
(additionalProperties)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema

DATA = Path(__file__).parent / "data"


def _strict(node: Any) -> Any:
    if isinstance(node, list):
        return [_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _strict(value) for key, value in node.items() if not key.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable"):
        kind = out.pop("type", None)
        if kind:
            out["type"] = [kind, "null"]
    out.pop("nullable", None)
    out.pop("format", None)  # int32/int64/date-time: the server's own parsers, not JSON Schema's
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def load_crd(name: str) -> dict[str, Any]:
    """The committed CRD schema file `name` as {"apiVersion", "kind", "schema" (strict)}."""
    doc = json.loads((DATA / name).read_text())
    return {"apiVersion": f"{doc['group']}/{doc['version']}", "kind": doc["kind"], "schema": _strict(doc["schema"])}


def problems(resource: dict[str, Any], crd: dict[str, Any]) -> list[str]:
    """What the API server would refuse in `resource`, one line each ([] when it is valid)."""
    found = [] if (resource.get("apiVersion"), resource.get("kind")) == (crd["apiVersion"], crd["kind"]) \
        else [f"apiVersion/kind {resource.get('apiVersion')}/{resource.get('kind')} is not {crd['apiVersion']}/{crd['kind']}"]
    validator = jsonschema.Draft7Validator(crd["schema"])
    found += [f"{'.'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
              for error in validator.iter_errors(resource)]
    return found

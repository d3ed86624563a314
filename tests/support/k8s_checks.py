"""Checks of Kubernetes manifests without a cluster: a CRD's OpenAPI v3 schema, and the kubernetes client's models.

:func:`check_against_crd` walks a custom resource against the ``openAPIV3Schema`` of the CRD version its
``apiVersion`` names, the way the API server's structural-schema validation and pruning treat it: ``type``,
``required``, ``properties``, ``enum``, ``items``, ``additionalProperties``, ``pattern``, int32/int64 ranges and
``x-kubernetes-int-or-string``. A field the schema does not name is an error unless the schema keeps unknown
fields (``x-kubernetes-preserve-unknown-fields``): the server would silently drop it, which for a manifest we
generate means a setting that never takes effect. The root ``metadata`` is the one open object (the server
checks it as ObjectMeta: :func:`check_object_meta`).

:func:`check_pod_template` deserializes a pod template into the client's ``V1PodTemplateSpec`` through the
public ``ApiClient.deserialize`` (types and required fields are checked by the models) and fails on every field
the models dropped, since the client ignores unknown fields silently.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

__all__ = ["check_against_crd", "check_pod_template", "check_object_meta", "crd_schema", "model_mismatches"]

_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,), "integer": (int,),
    "number": (int, float),
}


def crd_schema(crd: dict[str, Any], api_version: str, kind: str) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of the served CRD version that ``api_version``/``kind`` name."""
    group, _, version = api_version.rpartition("/")
    spec = crd["spec"]
    if group != spec["group"] or kind != spec["names"]["kind"]:
        raise ValueError(f"{api_version} {kind} is not {spec['group']} {spec['names']['kind']}")
    for entry in spec["versions"]:
        if entry["name"] == version and entry.get("served", False):
            return dict(entry["schema"]["openAPIV3Schema"])
    raise ValueError(f"the CRD serves no version {version!r}")


def check_against_crd(obj: dict[str, Any], crd: dict[str, Any]) -> list[str]:
    """Every way ``obj`` breaks the CRD's schema, as ``"path: problem"`` lines; empty when it conforms."""
    try:
        schema = crd_schema(crd, obj.get("apiVersion", ""), obj.get("kind", ""))
    except (KeyError, ValueError) as exc:
        return [f"apiVersion/kind: {exc}"]
    return list(_walk(obj, schema, ""))


def _walk(value: Any, schema: dict[str, Any], path: str) -> Iterator[str]:
    where = path or "<root>"
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            yield f"{where}: must be an integer or a string, got {type(value).__name__}"
            return
    elif "type" in schema:
        kind = schema["type"]
        if not isinstance(value, _JSON_TYPES[kind]) or (kind in ("integer", "number") and isinstance(value, bool)):
            yield f"{where}: must be {kind}, got {type(value).__name__} {value!r}"
            return
    if "enum" in schema and value not in schema["enum"]:
        yield f"{where}: {value!r} is not one of {schema['enum']}"
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        yield f"{where}: {value!r} does not match {schema['pattern']}"
    if isinstance(value, int) and schema.get("format") in _INT_RANGES:
        low, high = _INT_RANGES[schema["format"]]
        if not low <= value <= high:
            yield f"{where}: {value} is out of {schema['format']} range"
    if isinstance(value, dict):
        yield from _walk_object(value, schema, path)
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            yield from _walk(item, schema["items"], f"{path}[{index}]")


def _walk_object(value: dict[str, Any], schema: dict[str, Any], path: str) -> Iterator[str]:
    prefix = f"{path}." if path else ""
    for name in schema.get("required", []):
        if name not in value:
            yield f"{prefix}{name}: required field missing"
    properties = schema.get("properties")
    extra = schema.get("additionalProperties")
    for key, item in value.items():
        if properties is not None and key in properties:
            yield from _walk(item, properties[key], f"{prefix}{key}")
        elif isinstance(extra, dict):
            yield from _walk(item, extra, f"{prefix}{key}")
        elif schema.get("x-kubernetes-preserve-unknown-fields") or extra is True:
            continue
        elif path == "metadata" and properties is None:
            continue  # the root ObjectMeta: the server checks it itself (check_object_meta)
        else:
            yield f"{prefix}{key}: unknown field (the API server would drop it)"


def _unknown_fields(given: Any, kept: Any, path: str) -> Iterator[str]:
    """Paths in ``given`` that the model round trip ``kept`` lost."""
    if isinstance(given, dict):
        kept = kept if isinstance(kept, dict) else {}
        for key, item in given.items():
            where = f"{path}.{key}" if path else key
            if key not in kept:
                yield f"{where}: unknown field"
            else:
                yield from _unknown_fields(item, kept[key], where)
    elif isinstance(given, list):
        kept = kept if isinstance(kept, list) else []
        for index, item in enumerate(given):
            yield from _unknown_fields(item, kept[index] if index < len(kept) else None, f"{path}[{index}]")


def _check_model(obj: dict[str, Any], model: str) -> list[str]:
    from kubernetes.client import ApiClient

    client = ApiClient()
    try:
        parsed = client.deserialize(json.dumps(obj), model, "application/json")
    except Exception as exc:  # pydantic's ValidationError, whose text names the field and the problem
        return [f"{model}: {exc}"]
    return list(_unknown_fields(obj, client.sanitize_for_serialization(parsed), ""))


def check_pod_template(template: dict[str, Any]) -> list[str]:
    """Problems the kubernetes client's ``V1PodTemplateSpec`` finds in ``template``, unknown fields included."""
    return _check_model(template, "V1PodTemplateSpec")


def check_object_meta(metadata: dict[str, Any]) -> list[str]:
    """Problems ``V1ObjectMeta`` finds in an object's ``metadata``, unknown fields included."""
    return _check_model(metadata, "V1ObjectMeta")


def model_mismatches(schema: dict[str, Any], model: str, path: str = "") -> Iterator[str]:
    """Fields of a CRD schema that the kubernetes client's ``model`` lacks or types differently.

    Walks ``schema`` (for example the CRD's pod template) beside the model's ``openapi_types``: a field the
    model does not have, or a string where the model has an integer, means the schema was copied wrong
    (the CRD was generated from the same Go types the client is generated from, a few releases older).
    """
    from kubernetes import client

    cls = getattr(client, model)
    by_json_name = {json_name: attr for attr, json_name in cls.attribute_map.items()}
    for name, sub in schema.get("properties", {}).items():
        where = f"{path}.{name}" if path else name
        if name not in by_json_name:
            yield f"{where}: not a field of {model}"
            continue
        yield from _compare_type(sub, cls.openapi_types[by_json_name[name]], where)


_SCALARS = {"str": "string", "int": "integer", "bool": "boolean", "float": "number", "datetime": "string"}


def _compare_type(schema: dict[str, Any], model_type: str, path: str) -> Iterator[str]:
    model_type = re.sub(r"^Optional\[(.*)\]$", r"\1", model_type.strip())
    listed = re.fullmatch(r"List\[(.*)\]", model_type)
    mapped = re.fullmatch(r"Dict\[str, (.*)\]", model_type)
    if listed:
        if schema.get("type") != "array":
            yield f"{path}: the model has a list, the schema {schema.get('type')}"
        else:
            yield from _compare_type(schema.get("items", {}), listed.group(1), f"{path}[]")
    elif mapped:
        if schema.get("type") != "object" or "additionalProperties" not in schema:
            yield f"{path}: the model has a map, the schema {schema.get('type')}"
        else:
            yield from _compare_type(schema["additionalProperties"], mapped.group(1), f"{path}{{}}")
    elif model_type in _SCALARS:
        wanted = _SCALARS[model_type]
        if schema.get("type") != wanted and not (schema.get("x-kubernetes-int-or-string") and wanted == "string"):
            yield f"{path}: the model has {model_type}, the schema {schema.get('type')}"
    elif model_type.startswith("V1") or model_type.startswith("Core"):
        if schema.get("type") != "object":
            yield f"{path}: the model has {model_type}, the schema {schema.get('type')}"
        else:
            yield from model_mismatches(schema, model_type, path)

"""``labextension/src/models.ts`` mirrors ``taco_notebook/model.py`` field for field: the same fields, each of
the same type, read from both sources (a field added on one side only fails here, naming it)."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

import pytest

from taco_notebook import model

MODELS_TS = Path(__file__).resolve().parents[2] / "labextension" / "src" / "models.ts"
MIRRORS = {  # model.py's TypedDict -> its TypeScript interface
    model.ClusterModel: "IClusterModel", model.Owner: "IClusterOwner", model.NodeModel: "IClusterNode",
    model.HugePagesModel: "IHugepages", model.RunModel: "IClusterRun", model.PendingModel: "IPendingAction",
    model.LostRankModel: "ILostRank", model.MembershipModel: "IMembership", model.ClusterList: "IClusterList",
    model.ErrorModel: "IErrorBody",
}


def _interfaces(source: str) -> dict[str, dict[str, str]]:
    """Every ``export interface`` of ``source``: its fields and their type text (comments dropped)."""
    source = re.sub(r"/\*.*?\*/|//[^\n]*", "", source, flags=re.S)
    found = {}
    for name, body in re.findall(r"export interface (\w+) \{(.*?)\n\}", source, flags=re.S):
        fields = re.findall(r"^\s*(\w+)\??: ([^;]+);", body, flags=re.M)
        found[name] = {field: " ".join(kind.split()) for field, kind in fields}
    return found


def _aliases(source: str) -> dict[str, str]:
    return {name: " ".join(kind.split()) for name, kind in re.findall(r"export type (\w+) =([^;]+);", source)}


def _ts(annotation: object) -> str:
    """How ``annotation`` (a model.py field type) is written in models.ts."""
    interface = {typed: name for typed, name in MIRRORS.items()}.get(annotation)  # type: ignore[call-overload]
    if interface is not None:
        return interface
    if annotation is model.State:
        return "ClusterState"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(f"'{value}'" for value in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if arg is type(None) else _ts(arg) for arg in args)
    if origin is list:
        return f"{_ts(args[0])}[]"
    return {int: "number", float: "number", str: "string", bool: "boolean"}[annotation]  # type: ignore[index]


@pytest.fixture(scope="module")
def interfaces() -> dict[str, dict[str, str]]:
    return _interfaces(MODELS_TS.read_text())


@pytest.mark.parametrize("typed", list(MIRRORS), ids=lambda typed: typed.__name__)
def test_each_interface_has_the_typed_dicts_fields_and_types(typed: type,
                                                             interfaces: dict[str, dict[str, str]]) -> None:
    hints = typing.get_type_hints(typed, include_extras=True)
    mirrored = interfaces[MIRRORS[typed]]
    assert set(mirrored) == set(hints), (f"{MIRRORS[typed]} has {sorted(set(mirrored) - set(hints))} that "
                                         f"{typed.__name__} has not, and lacks {sorted(set(hints) - set(mirrored))}")
    wrong = {field: (mirrored[field], _ts(kind)) for field, kind in hints.items() if mirrored[field] != _ts(kind)}
    assert not wrong, f"{MIRRORS[typed]}: fields typed otherwise than {typed.__name__} (models.ts, model.py): {wrong}"


def test_the_state_alias_and_list_name_the_same_states_in_the_same_order() -> None:
    source = MODELS_TS.read_text()
    states = typing.get_args(model.State)
    assert _aliases(source)["ClusterState"] == " | ".join(f"'{state}'" for state in states)
    listed = re.search(r"CLUSTER_STATES: readonly ClusterState\[\] = \[(.*?)\];", source, flags=re.S)
    assert listed is not None and tuple(re.findall(r"'(\w+)'", listed.group(1))) == states


def test_the_reader_sees_a_drifted_field() -> None:
    """The comparison is not vacuous: an interface with a field renamed and one retyped is caught."""
    drifted = _interfaces("export interface IHugepages {\n  total: number;\n  free: string;\n  page: number;\n}")
    hints = typing.get_type_hints(model.HugePagesModel)
    assert set(drifted["IHugepages"]) != set(hints)
    assert drifted["IHugepages"]["free"] != _ts(hints["free"])

"""Save a started :class:`~taco_notebook.emulate.nodes.EmulatedNodes` to a file and find it again later.

Emulated nodes made by ``python -m taco_notebook emulate up`` outlive the process that made them; ``status`` and
``down`` run in other processes. What they need to find and undo the set (its random name prefix, subnet, the
namespaces and links it made, its work directory) is written as JSON to a private file (0600, through
:func:`~taco_notebook.private.write_private_json`) and read back only if that file is a regular file of
this user. Names read back must carry the set's own prefix, so even an edited file cannot make ``stop`` delete
a namespace or link that is not the set's.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Any

from ..private import read_private_json, write_private_json
from .nodes import EmulatedNodes

__all__ = ["save_nodes", "load_nodes", "nodes_state", "STATE_VERSION"]

STATE_VERSION = 1
_MAX_STATE_BYTES = 1 << 20
_PREFIX = re.compile(r"taco-[0-9a-f]{5}")


def nodes_state(nodes: EmulatedNodes) -> dict[str, Any]:
    """The JSON-able state of a started set (what :func:`load_nodes` needs to rebuild it)."""
    workdir = Path(nodes.launcher).parent  # raises if the set is not started
    return {"version": STATE_VERSION, "prefix": nodes.prefix, "num_nodes": len(nodes.nodes),
            "rate_bits_per_s": nodes.rate_bits_per_s, "interface": nodes.interface,
            "subnet": str(nodes.subnet), "workdir": str(workdir),
            "made": [list(item) for item in nodes.made]}


def save_nodes(nodes: EmulatedNodes, path: Path) -> None:
    """Write ``nodes``' state to ``path`` (0600, atomically; its directory is made 0700 when missing)."""
    write_private_json(path, nodes_state(nodes), what="emulated nodes' state directory")
    nodes.detach()  # from here on the file is how it is found and stopped


def load_nodes(path: Path) -> EmulatedNodes:
    """The started set saved in ``path``; ValueError naming the file when it is not a state file of ours."""
    state = read_private_json(path, os.geteuid(), _MAX_STATE_BYTES)
    return nodes_from_state(state, where=str(path))


def nodes_from_state(state: Any, where: str = "state") -> EmulatedNodes:
    """Rebuild a started :class:`EmulatedNodes` from :func:`nodes_state`'s dict (checked field by field)."""
    try:
        if state["version"] != STATE_VERSION:
            raise ValueError(f"version {state['version']!r}, expected {STATE_VERSION}")
        prefix = str(state["prefix"])
        if not _PREFIX.fullmatch(prefix):
            raise ValueError(f"prefix {prefix!r} is not a name this package makes")
        made = [(str(kind), str(name)) for kind, name in state["made"]]
        for kind, name in made:
            if kind not in ("link", "netns") or not name.startswith(prefix + "-"):
                raise ValueError(f"{kind} {name!r} is not one of the set's own")
        rate = state["rate_bits_per_s"]
        nodes = EmulatedNodes.restore(int(state["num_nodes"]), None if rate is None else int(rate),
                                      str(state["interface"]), prefix=prefix,
                                      subnet=ipaddress.IPv4Network(state["subnet"]), workdir=Path(state["workdir"]),
                                      made=made)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{where}: not a state file of emulated nodes ({err}); remove it if nothing runs") from None
    return nodes

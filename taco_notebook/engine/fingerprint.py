"""``%taco_diff``'s rank side: a value's fingerprint tree, to compare across ranks without moving the value.

Each node is ``{"d": digest, "s": summary, "k": [[label, node], …]}``: a digest of the whole value (equal
values give equal digests on every rank), a short description for the report, and for containers their
children, labelled as a path step (``[2]``, ``['lr']``, ``.fc.weight``), so the notebook can walk down to the
first place the ranks differ. Tensors and arrays are digested from their bytes (with dtype and shape), a
module and an optimizer through their ``state_dict()``, numbers and strings through their repr, any other
object through its pickle (else its repr, said so).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping
from typing import Any

from .calls import user_shell

__all__ = ["MAX_DEPTH", "MAX_CHILDREN", "fingerprint", "describe"]

MAX_DEPTH = 8  # containers deeper than this are compared whole, by digest
MAX_CHILDREN = 4096  # children listed of one container; past that it is compared whole
_SUMMARY_CHARS = 80
_SCALARS = (int, float, complex, bool, str, bytes, type(None))


def _digest(*parts: bytes | str) -> str:
    h = hashlib.blake2b(digest_size=12)
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()


def _short(text: str) -> str:
    return text if len(text) <= _SUMMARY_CHARS else text[: _SUMMARY_CHARS - 1] + "…"


def _tensor(value: Any) -> dict[str, Any]:
    import torch

    t = value.detach()
    if t.is_sparse:
        t = t.to_dense()
    kind = f"tensor {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
    if t.device.type == "meta":
        return {"d": _digest(kind, "meta"), "s": f"{kind} on meta"}
    host = t.cpu().contiguous()
    raw = host.reshape(-1).view(torch.uint8).numpy().tobytes() if host.numel() else b""
    if host.numel() == 1:
        shown = f"{kind} = {host.item()!r}"
    elif host.numel() == 0 or host.is_complex():
        shown = kind
    else:
        shown = f"{kind}, sum {host.double().sum().item():.6g}"
    return {"d": _digest(kind, raw), "s": shown}


def _array(value: Any) -> dict[str, Any]:
    kind = f"ndarray {value.dtype}{list(value.shape)}"
    return {"d": _digest(kind, value.tobytes()), "s": kind}


def _container(kind: str, items: list[tuple[str, Any]], depth: int) -> dict[str, Any]:
    if depth >= MAX_DEPTH or len(items) > MAX_CHILDREN:
        return _opaque(kind, dict(items), f"{kind} of {len(items)} (compared whole)")
    children = [(label, _node(value, depth + 1)) for label, value in items]
    return {"d": _digest(kind, *(f"{label}={child['d']}" for label, child in children)),
            "s": f"{kind} of {len(items)}", "k": children}


def _opaque(kind: str, value: Any, summary: str | None = None) -> dict[str, Any]:
    try:
        payload: bytes | str = pickle.dumps(value, protocol=4)
        how = summary or _short(f"{kind}: {value!r}")
    except Exception:  # noqa: BLE001 - not picklable: compared by its repr, and said so
        payload = repr(value)
        how = _short(f"{kind} (compared by repr): {payload}")
    return {"d": _digest(kind, payload), "s": how}


def _node(value: Any, depth: int = 0) -> dict[str, Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if type(value).__module__ == "numpy" and hasattr(value, "tobytes") and hasattr(value, "shape"):
        return _array(value)
    if isinstance(value, _SCALARS):
        return {"d": _digest(type(value).__name__, repr(value)), "s": _short(repr(value))}
    if isinstance(value, torch.nn.Module | torch.optim.Optimizer):
        state = value.state_dict()
        prefix = "." if isinstance(value, torch.nn.Module) else ""
        items = [(f"{prefix}{key}" if prefix else f"[{key!r}]", item) for key, item in state.items()]
        return _container(type(value).__name__, items, depth)
    if isinstance(value, Mapping):
        return _container(type(value).__name__, [(f"[{key!r}]", item) for key, item in value.items()], depth)
    if isinstance(value, list | tuple):
        return _container(type(value).__name__, [(f"[{i}]", item) for i, item in enumerate(value)], depth)
    if isinstance(value, set | frozenset):
        members = sorted(_node(item, depth + 1)["d"] for item in value)
        return {"d": _digest(type(value).__name__, *members), "s": f"{type(value).__name__} of {len(value)}"}
    return _opaque(type(value).__name__, value)


def fingerprint(value: Any) -> dict[str, Any]:
    """The fingerprint tree of ``value`` (module docstring)."""
    return _node(value)


def describe(expression: str) -> dict[str, Any]:
    """``expression`` evaluated in this rank's namespace, as a fingerprint tree; what it raised, as a node too
    (ranks that raise the same are grouped, as equal values are)."""
    try:
        value = eval(expression, user_shell().user_ns)  # noqa: S307 - the notebook user's own expression
    except Exception as exc:  # noqa: BLE001 - its error is this rank's answer
        said = f"raised {type(exc).__name__}: {exc}"
        return {"d": _digest("error", said), "s": _short(said)}
    return fingerprint(value)

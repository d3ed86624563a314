"""REST request bodies parsed into the cluster model's request types, and the errors the manager raises.

Parsed here, whatever calls the manager, so that every 400 names the field at fault. No tornado import. The
model itself (what a cluster is) lives in :mod:`taco_notebook.model`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ..cluster.launch.limits import SizeLimitError, check_size
from ..model import PEEK_TIMEOUT_S, ScaleRequest, StartRequest

__all__ = [
    "ManagerError", "BadRequest", "NotFound", "Conflict", "TooLarge",
    "parse_start_request", "parse_scale_request", "parse_peek_request", "check_cluster_id", "NAME_PATTERN",
    "MAX_BODY_BYTES", "shorten",
]

MAX_BODY_BYTES = 64 * 1024  # a request body is a few dozen bytes; larger ones are refused (413) before parsing


class ManagerError(Exception):
    """A request the manager refuses; ``status`` is the HTTP code the handlers answer with."""

    status = 500


class BadRequest(ManagerError):
    status = 400


class NotFound(ManagerError):
    status = 404


class Conflict(ManagerError):
    status = 409


class TooLarge(ManagerError):
    status = 413


def shorten(value: Any, limit: int = 40) -> str:
    """``value`` as JSON for an error message, cut to ``limit`` characters: never echo a whole request back."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _json_object(body: bytes | str | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(body, Mapping):
        return dict(body)
    if len(body) > MAX_BODY_BYTES:
        raise TooLarge(f"request body of {len(body)} bytes is over the limit of {MAX_BODY_BYTES} bytes")
    try:
        parsed = json.loads(body or b"")
    except RecursionError:
        raise BadRequest("request body must be a JSON object, e.g. {\"size\": 2}: it is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body must be a JSON object, e.g. {{\"size\": 2}}: {str(exc)[:100]}") from None
    if not isinstance(parsed, dict):
        raise BadRequest(f"request body must be a JSON object, e.g. {{\"size\": 2}}, got {type(parsed).__name__}")
    return parsed


def _check_fields(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        shown = ", ".join(repr(f) if len(f) <= 40 else repr(f[:37] + "...") for f in unknown[:5])
        raise BadRequest(f"unknown field(s) {shown}{', ...' if len(unknown) > 5 else ''}; "
                         f"allowed: {', '.join(allowed)}")


def _size(body: dict[str, Any]) -> int:
    if "size" not in body:
        raise BadRequest("field 'size' is required: the number of MPI ranks, a positive integer")
    size = body["size"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise BadRequest(f"field 'size' must be a positive integer, got {shorten(size)}")
    try:
        return check_size(size, "field 'size'")  # the one limit, shared with the magics and request files
    except SizeLimitError as exc:
        raise BadRequest(str(exc)) from None


def parse_start_request(body: bytes | str | Mapping[str, Any]) -> StartRequest:
    """Validate a start body: ``{"size": int >= 1, "name"?: str}``; raises :class:`BadRequest` naming the field."""
    parsed = _json_object(body)
    _check_fields(parsed, ("size", "name"))
    request: StartRequest = {"size": _size(parsed)}
    if "name" in parsed:
        name = parsed["name"]
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise BadRequest(f"field 'name' must be 1-64 letters, digits, '_', '.' or '-' (starting with a letter "
                             f"or digit), got {shorten(name)}")
        request["name"] = name
    return request


def parse_scale_request(body: bytes | str | Mapping[str, Any]) -> ScaleRequest:
    """Validate a scale body: ``{"size": int >= 1}``; raises :class:`BadRequest` naming the field."""
    parsed = _json_object(body)
    _check_fields(parsed, ("size",))
    return {"size": _size(parsed)}


def parse_peek_request(body: bytes | str | Mapping[str, Any]) -> dict[str, Any]:
    """Validate a peek body: ``{"expr": str, "ranks"?: [int, …], "timeout"?: seconds}``; raises
    :class:`BadRequest` naming the field. ``ranks`` None: every rank; ``timeout`` by default 1 s."""
    parsed = _json_object(body)
    _check_fields(parsed, ("expr", "ranks", "timeout"))
    expr = parsed.get("expr")
    if not isinstance(expr, str) or not expr.strip():
        raise BadRequest(f"field 'expr' is required: a Python expression, e.g. \"loss.item()\", got {shorten(expr)}")
    ranks = parsed.get("ranks")
    if ranks is not None and (not isinstance(ranks, list) or not ranks or any(
            isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks)):
        raise BadRequest(f"field 'ranks' must be a non-empty list of ranks (integers >= 0), got {shorten(ranks)}")
    timeout = parsed.get("timeout", 1.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= PEEK_TIMEOUT_S:
        raise BadRequest(f"field 'timeout' must be seconds in (0, {PEEK_TIMEOUT_S:g}], got {shorten(timeout)}")
    return {"expr": expr, "ranks": ranks, "timeout": float(timeout)}


_ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # a name (<= 64) plus "-<pid>-<hex>"


def check_cluster_id(cluster_id: str) -> str:
    """A cluster id safe to use as a file name and not a request file's (``{id}.request``); anything else cannot
    exist, so it is a :class:`NotFound`."""
    if not _ID_PATTERN.fullmatch(cluster_id) or cluster_id.startswith(".") or cluster_id.endswith(".request"):
        shown = cluster_id if len(cluster_id) <= 80 else cluster_id[:77] + "..."
        raise NotFound(f"No such cluster: {shown}")
    return cluster_id

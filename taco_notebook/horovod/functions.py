"""Horovod's helpers over the tensor collectives: parameters, optimizer state and Python objects.

``broadcast_parameters`` takes what Horovod's takes (a ``state_dict()`` or ``named_parameters()``; a module
too); ``broadcast_optimizer_state`` makes every rank's optimizer state equal to ``root_rank``'s, including one
that has not stepped yet. As Horovod, a fresh optimizer's state is built first by one step on zero gradients
(which it leaves in ``p.grad``); unlike Horovod, the parameters are put back after that step, so weight decay
does not move them. The root's state is then described (names, shapes, dtypes and its non-tensor values) to
every rank, which allocate what they lack, and the tensors are broadcast in place. Objects travel pickled in
a byte tensor (Horovod does the same with cloudpickle).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable
from typing import Any

import torch

from ..comm.collectives import ops as collectives
from .basics import check_initialized, check_process_set, rank

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def _named_tensors(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, torch.nn.Module):
        return list(params.state_dict(keep_vars=True).items())
    if isinstance(params, dict):
        return sorted(params.items(), key=lambda item: str(item[0]))
    if isinstance(params, Iterable):
        return list(params)
    raise ValueError(f"invalid params of type: {type(params)}; pass model.state_dict() or model.named_parameters()")


def broadcast_parameters(params: Any, root_rank: int = 0, prefix: str | None = None) -> None:
    """Copy ``root_rank``'s parameters (a ``state_dict()``, ``named_parameters()`` or a module) into every
    rank's, in place. Call it once after building the model (and after loading a checkpoint on the root)."""
    check_initialized()
    for name, value in _named_tensors(params):
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name!r} is a {type(value).__name__}, not a tensor")
        with torch.no_grad():
            collectives.broadcast(value.data if isinstance(value, torch.nn.Parameter) else value, root_rank)


def _to_bytes(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    pickle.dump(obj, buffer, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _from_bytes(data: torch.Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())  # noqa: S301 - the job's own ranks sent it


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None) -> Any:
    """``root_rank``'s ``obj`` (any picklable object), returned on every rank."""
    check_initialized()
    group = check_process_set(process_set)
    data = _to_bytes(obj) if rank() == root_rank else torch.empty(0, dtype=torch.uint8)
    length = collectives.broadcast(torch.tensor([data.numel()], dtype=torch.int64), root_rank, group=group)
    if rank() != root_rank:
        data = torch.empty(int(length.item()), dtype=torch.uint8)
    collectives.broadcast(data, root_rank, group=group)
    return obj if rank() == root_rank else _from_bytes(data)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Every rank's ``obj`` (any picklable object), as a list in rank order, on every rank."""
    check_initialized()
    group = check_process_set(process_set)
    data = _to_bytes(obj)
    lengths = collectives.allgather(torch.tensor([data.numel()], dtype=torch.int64), group=group).tolist()
    gathered = collectives.allgather(data, group=group)
    out, offset = [], 0
    for length in lengths:
        out.append(_from_bytes(gathered[offset : offset + length]))
        offset += length
    return out


def _params_by_index(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in ``state_dict()`` index order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _describe(state: dict[Any, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """The state with each tensor replaced by ``("tensor", shape, dtype, on_cpu)``: what the root sends."""
    return {
        pid: {
            key: ("tensor", tuple(v.shape), v.dtype, v.device.type == "cpu") if isinstance(v, torch.Tensor) else v
            for key, v in entries.items()
        }
        for pid, entries in state.items()
    }


def _build_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state, as Horovod does: zero gradients and one step of the wrapped optimizer
    (not the distributed one: nothing is reduced); the parameters are restored after it."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    kept = [p.detach().clone() for p in params]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    with torch.no_grad():
        for p, value in zip(params, kept, strict=True):
            p.copy_(value)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int = 0, prefix: str = "Parameter.", model: Any = None
) -> None:
    """Make every rank's optimizer state (per-parameter state and each group's options) ``root_rank``'s.

    Accepts a ``torch.optim.Optimizer`` or an ``hvd.DistributedOptimizer``.
    """
    check_initialized()
    inner = getattr(optimizer, "optimizer", optimizer)
    if isinstance(inner, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not inner.state_dict()["state"]:
        _build_state(inner)
    local = inner.state_dict()
    root = broadcast_object({"state": _describe(local["state"]), "param_groups": local["param_groups"]}, root_rank)
    params = _params_by_index(inner)
    state: dict[Any, dict[str, Any]] = {}
    for pid in sorted(root["state"], key=str):
        entries = state[pid] = {}
        for key in sorted(root["state"][pid], key=str):
            value = root["state"][pid][key]
            if not (isinstance(value, tuple) and len(value) == 4 and value[0] == "tensor"):
                entries[key] = value
                continue
            _, shape, dtype, on_cpu = value
            mine = local["state"].get(pid, {}).get(key)
            if not (isinstance(mine, torch.Tensor) and tuple(mine.shape) == shape and mine.dtype == dtype):
                device = torch.device("cpu") if on_cpu else params[pid].device
                mine = torch.zeros(shape, dtype=dtype, device=device)
            entries[key] = collectives.broadcast(mine, root_rank)
    inner.load_state_dict({"state": state, "param_groups": root["param_groups"]})

"""What taco trains on a rank now (what the replica check knows), and how to tell it changed without reading it.

:mod:`.undo` copies it before a cell; before the next one it compares :func:`signature` (each tensor's identity,
storage, in-place counter ``_version`` and shape; the optimizers' hyper-parameters; the States' commits and
counters; the group's count of collectives) and :func:`samples` (16 elements of each tensor: a write through
``.data`` leaves the counter alone) with what they were, and copies again only when either differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the notebook imports .undo to name its functions: torch only where they run
    import torch

__all__ = ["SAMPLES", "Tracked", "tracked", "token", "signature", "samples"]

SAMPLES = 16  # elements per tensor compared with the copy's


@dataclass
class Tracked:
    """What taco trains on this rank now, in registration order: parameters, optimizers (the torch one a
    DistributedOptimizer wraps) and live ``taco.elastic.State``s."""

    params: list[torch.Tensor] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    states: list[Any] = field(default_factory=list)

    def tensors(self) -> list[torch.Tensor]:
        """The parameters, then the optimizers' state tensors."""
        import torch

        state = [v for o in self.optimizers for values in o.state.values() for v in values.values()
                 if isinstance(v, torch.Tensor)]
        return [*self.params, *state]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def __bool__(self) -> bool:
        return bool(self.params or self.optimizers or self.states)


def tracked() -> Tracked:
    """The live registered parameters and optimizers (:mod:`.replicas`) and the live States."""
    from ..comm.diagnostics import replicas
    from ..comm.training.elastic import live_states

    params = [ref() for ref, _, _ in sorted(list(replicas._params.values()), key=lambda entry: entry[2])]
    optimizers = [ref() for ref, _ in sorted(list(replicas._optimizers.values()), key=lambda entry: entry[1])]
    return Tracked([p for p in params if p is not None], [o for o in optimizers if o is not None],
                   sorted(live_states(), key=lambda s: s.order))


def token(value: Any) -> Any:
    """What tells that a value changed without reading it: a tensor's identity, storage, in-place counter, shape."""
    import torch

    if isinstance(value, torch.Tensor):
        return (id(value), value.data_ptr(), value._version, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return tuple((key, token(item)) for key, item in value.items())
    if type(value) in (list, tuple):
        return tuple(token(item) for item in value)
    return value


def signature(now: Tracked) -> tuple[Any, ...]:
    """The marks of ``now`` that a change moves (compared with ``==``)."""
    from ..comm.state import state

    board = state.board  # its count of collectives: a broadcast into .data moves no tensor's counter
    return (tuple(token(p) for p in now.params),
            tuple((id(o), token(o.param_groups), tuple((id(p), token(v)) for p, v in o.state.items()))
                  for o in now.optimizers),
            tuple((id(s), id(s._saved), s.commits, token(s.counters)) for s in now.states),
            (id(board), board.seq) if board is not None else None)


def samples(tensors: list[torch.Tensor]) -> torch.Tensor:
    """16 strided elements of each tensor, in float64 on the host (one transfer per device)."""
    import torch

    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        flat = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat
        picked = flat[:: max(1, flat.numel() // SAMPLES)][:SAMPLES]
        by_device.setdefault(flat.device, []).append(picked.to(torch.float64))
    parts = [torch.cat(found).cpu() for found in by_device.values()]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)

"""Per-process defaults of comm/: algorithm, compression, fusion threshold, shared memory, collective timeout.

Defaults come from the environment (parsed in :mod:`.specs`): TACO-Training's LightCC flags, so jobs tuned for
it behave the same here (``LIGHT_2D_ALLREDUCE``: 1 = hierarchical, 0 = flat, unset = hierarchical when the job
spans several nodes with several ranks each; ``LIGHT_TOPK_ALLREDUCE`` / ``LIGHT_TOPK_RATIO`` /
``LIGHT_TOPK_THRESHOLD``: TopK compression), ``TACO_FUSION_MB`` (Horovod's fusion threshold, 64 MB by default),
``TACO_SHM`` (0 keeps the intra-node steps on the process group: 2D's, a one-node job's allreduce),
``TACO_COLLECTIVE_TIMEOUT`` (seconds, 1800 by default), ``TACO_STALL_TIMEOUT`` (seconds, 300 by default, 0 =
off: see :mod:`.stall`) and ``TACO_CHUNK_MB`` (the 2D pipeline's chunk in MiB; ``auto``, the default, picks it
from measured speeds; 0 turns pipelining off). ``configure()``, each call's arguments and, from a notebook,
``%%taco_run``'s options and ``TacoMagics`` traits (``--algorithm/--compression/--fusion-mb`` configure the ranks
for a cell; ``--shm/--collective-timeout`` go into the cluster's environment, see :mod:`taco_notebook.plan.settings`)
override them. The environment is read when a setting is first used, not at import.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .compression.compressors import Compressor, build
from .compression.spec import CompressionSpec
from .specs import (
    ALGORITHMS,
    DEFAULT_FUSION_MB,
    algorithm_from_env,
    check_algorithm,
    check_chunk_mb,
    check_fusion_mb,
    check_stall_timeout,
    check_timeout,
    chunk_mb_from_env,
    fusion_mb_from_env,
    shm_from_env,
    stall_timeout_from_env,
    timeout_from_env,
)

__all__ = ["ALGORITHMS", "DEFAULT_FUSION_MB", "Settings", "settings", "configure", "compressor_for",
           "algorithm_from_env", "check_algorithm", "check_fusion_mb"]


@dataclass(frozen=True)
class Settings:
    algorithm: str  # "auto" picks 2d when the job spans several nodes of several ranks each
    compression: CompressionSpec  # what crosses the network; str(compression) is its text, e.g. "topk:0.01"
    fusion_mb: float  # gradients are packed into buckets up to this size before each allreduce
    shm: bool = True  # intra-node steps (2D, and one-node jobs) through a shared-memory segment (CPU tensors)
    collective_timeout: float = 1800.0  # seconds a collective (and the rendezvous) of the next init() waits
    stall_timeout: float = 300.0  # seconds a collective waits for missing ranks before it fails naming them; 0: off
    # 2D pipeline chunk in MiB: None = from the speeds measured when the 2D groups are built (see
    # pipeline.Calibration), 0 = one chunk (no overlap of the shared-memory passes with the network)
    chunk_mb: float | None = None


def _from_env() -> Settings:
    return Settings(algorithm_from_env(), CompressionSpec.from_env(), fusion_mb_from_env(), shm_from_env(),
                    timeout_from_env(), stall_timeout_from_env(), chunk_mb_from_env())


_current: Settings | None = None
_compressors: dict[CompressionSpec, Compressor] = {}  # a spec -> its one instance on this rank


def settings() -> Settings:
    """The defaults in force on this rank."""
    global _current
    if _current is None:
        _current = _from_env()
    return _current


def configure(algorithm: str | None = None, compression: CompressionSpec | str | None = None,
              fusion_mb: float | None = None,
              reset: bool = False, *, shm: bool | None = None,
              collective_timeout: float | None = None, stall_timeout: float | str | None = None,
              chunk_mb: float | str | None = None) -> Settings:
    """Change this rank's defaults (``reset=True`` goes back to the environment's). Returns the new ones.

    ``compression`` is a :class:`.compression.spec.CompressionSpec` or its text (``"topk:0.01"``), parsed
    here once; ``settings().compression`` is then the spec value.

    ``shm`` applies to the 2D groups built next (after ``reinit()``), ``collective_timeout`` to the next
    ``init()``/``reinit()``: both are fixed when the groups are made. ``stall_timeout`` (seconds, 0 or
    ``"off"`` for never) applies from the next collective on (:mod:`.stall`); ``chunk_mb`` sets the 2D pipeline's
    chunk size in MiB from the next allreduce on (``"auto"``: from measured speeds; 0: no pipelining).
    """
    global _current
    base = _from_env() if reset else settings()
    changes: dict[str, object] = {}
    if algorithm is not None:
        changes["algorithm"] = check_algorithm(algorithm)
    if compression is not None:
        changes["compression"] = CompressionSpec.parse(compression)
    if fusion_mb is not None:
        changes["fusion_mb"] = check_fusion_mb(fusion_mb)
    if shm is not None:
        if not isinstance(shm, bool):
            raise TypeError(f"shm must be True or False, got {shm!r}")
        changes["shm"] = shm
    if collective_timeout is not None:
        changes["collective_timeout"] = check_timeout(collective_timeout)
    if stall_timeout is not None:
        changes["stall_timeout"] = check_stall_timeout(stall_timeout)
    if chunk_mb is not None:
        changes["chunk_mb"] = check_chunk_mb(chunk_mb)
    _current = replace(base, **changes)  # type: ignore[arg-type]
    return _current


def compressor_for(spec: CompressionSpec | str | None) -> Compressor:
    """This rank's one compressor for ``spec`` (None: the default, ``settings().compression``), built by
    :func:`.compression.compressors.build` the first time, so TopK's and PowerSGD's residuals persist across
    steps. Called for every allreduce: a spec value is a dict lookup; text (a user's ``compression="fp16"``)
    goes through :meth:`~.compression.spec.CompressionSpec.parse`, which caches what it parsed."""
    chosen = settings().compression if spec is None else CompressionSpec.parse(spec)
    found = _compressors.get(chosen)
    if found is None:
        found = _compressors[chosen] = build(chosen)
    return found

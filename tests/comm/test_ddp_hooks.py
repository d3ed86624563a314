"""taco's DDP comm hook under real ``mpiexec`` on 2 ranks: one job covering every compression, ``no_sync``,
``static_graph``, ``find_unused_parameters``, None and process-group states and DDP's bucket rebuild
(the checks are in tests/mpi/ddp_hooks.py; ~20-30 s on 2 busy cores)."""

from __future__ import annotations

import re

from ..support.mpirun import run_mpi


def test_ddp_hook_follows_buckets_and_keeps_replicas_identical(mpiexec):
    result = run_mpi(mpiexec, 2, "ddp_hooks.py", timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(re.findall(r"OK (\d+)", result.stdout)) == ["0", "1"], result.stdout + result.stderr

"""``%%taco_run --stall-timeout``: a rank that never enters a collective fails the cell, named, instead of hanging it,
and the next cell on the same cluster works (real IPython shell, real MPI-launched engines)."""

from __future__ import annotations

import re
import time

import pytest

from taco_notebook.cluster.session import clusters
from taco_notebook.errors import RankFailedError

pytestmark = pytest.mark.cluster

ALLREDUCE_CELL = "t = torch.full((3,), float(taco.rank()))\ntaco.allreduce(t)\nt.tolist()"
# how many communication threads each rank has, once those stuck in an abandoned collective had 5 s to go
COMM_THREADS_CELL = """\
import threading, time
deadline = time.monotonic() + 5
while sum(t.name == 'taco-comm' for t in threading.enumerate()) > 1 and time.monotonic() < deadline:
    time.sleep(0.1)
sum(t.name == 'taco-comm' for t in threading.enumerate())
"""


def engine_pids() -> list[int]:
    return [r.pid for r in clusters["default"].ranks]


def test_a_sleeping_rank_is_named_and_the_next_cell_runs(ip, shared_cluster, capsys):
    pids = engine_pids()
    cell = ("import time\nt = torch.ones(2)\ntaco.allreduce(t, name=('ddp-bucket', 2))\nif taco.rank() == 3:\n"
            "    time.sleep(6)\ntaco.allreduce(t, name='step')")
    began = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        ip.run_cell_magic("taco_run", "--stall-timeout 3", cell)
    elapsed = time.monotonic() - began
    message = str(info.value)
    assert re.search(r" raised StallError: allreduce #(\d+) 'step' stalled 3 s: rank 3 \(host ", message), message
    # where the late rank is, named whole in the summary and in the line shown while the others are waited for
    where = re.compile(r"StallError: allreduce #\d+ 'step' stalled 3 s: rank 3 \(host \S+\) has not arrived; "
                       r"rank 3 is at allreduce #\d+ \('ddp-bucket', 2\)(…|;)")
    assert where.search(message), message
    waiting = [line for line in capsys.readouterr().err.splitlines() if "; waiting for the other ranks" in line]
    assert waiting and where.search(waiting[0]), waiting
    assert "; rank 3 stalled (never entered the collective the others waited in)" in message, message
    # rank 3 entered 6 s in, found its peers gone and raised itself: not interrupted by the failure ladder
    assert re.search(r"rank 3: StallError: allreduce #(\d+) 'step': ranks 0, 1, 2 gave up waiting at collective "
                     r"#\1", message), message
    assert elapsed < 30, (elapsed, message)
    assert ip.run_cell_magic("taco_run", "", ALLREDUCE_CELL) == [6.0, 6.0, 6.0]  # the group was rebuilt
    assert engine_pids() == pids  # on the same engines
    assert ip.run_cell_magic("taco_run", "--gather", COMM_THREADS_CELL) == [1, 1, 1, 1]


def test_a_rank_that_never_comes_is_interrupted_and_nothing_stays_blocked(ip, shared_cluster):
    """Rank 3 sleeps for minutes: the waiting ranks fail after 3 s, the cell's failure handling interrupts rank 3
    (after its grace for the other ranks), and no thread is left in the abandoned allreduce afterwards."""
    pids = engine_pids()
    cell = "import time\nt = torch.ones(2)\nif taco.rank() == 3:\n    time.sleep(300)\ntaco.allreduce(t)"
    began = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        ip.run_cell_magic("taco_run", "--stall-timeout 3", cell)
    message = str(info.value)
    assert re.search(r" raised StallError: allreduce #\d+ stalled 3 s: rank 3 \(host ", message), message
    assert "rank 3 stalled" in message and "rank 3: KeyboardInterrupt" in message, message
    assert time.monotonic() - began < 40
    assert ip.run_cell_magic("taco_run", "", ALLREDUCE_CELL) == [6.0, 6.0, 6.0]
    assert engine_pids() == pids
    assert ip.run_cell_magic("taco_run", "--gather", COMM_THREADS_CELL) == [1, 1, 1, 1]


def test_the_option_reaches_the_ranks_for_one_cell(ip, shared_cluster):
    cell = "taco.settings().stall_timeout"
    assert ip.run_cell_magic("taco_run", "--stall-timeout off --gather", cell) == [0.0] * 4
    assert ip.run_cell_magic("taco_run", "--stall-timeout 12.5", cell) == 12.5
    assert ip.run_cell_magic("taco_run", "", cell) == 300.0  # back to the ranks' default after the cell

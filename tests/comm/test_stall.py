"""The stall watchdog under plain ``mpiexec``: a rank that does not enter a collective is named within the stall
timeout, the job does not hang, and the group can be rebuilt (tests/mpi/stall.py); its settings' checks."""

from __future__ import annotations

import re
import time

import pytest

from taco_notebook.comm.config import configure, settings
from taco_notebook.comm.specs import DEFAULT_STALL_TIMEOUT_S, stall_timeout_from_env

from ..support.mpirun import run_mpi

STALL_S = 3.0
SLACK_S = 3.0  # a loaded 2-core machine: the watchdog's wake-up and tearing the group down (about 0.5 s)


def stalls(stdout: str) -> dict[int, tuple[float, str, str, str]]:
    """rank -> (seconds waited, missing, gave_up, message) from the script's ``STALL`` lines."""
    found = re.findall(r"^STALL (\d+) ([\d.]+) missing=(\[[\d, ]*\]) gave_up=(\[[\d, ]*\]) (.*)$", stdout, re.M)
    return {int(rank): (float(waited), missing, gave_up, message) for rank, waited, missing, gave_up, message in found}


def test_a_rank_sleeping_before_an_allreduce_is_named_and_the_job_ends(mpiexec):
    """Rank 3 sleeps 60 s; ranks 0-2 raise StallError naming it after the 3 s timeout; the job ends then."""
    env = {"MODE": "fail", "TACO_STALL_TIMEOUT": str(STALL_S)}
    began = time.monotonic()
    result = run_mpi(mpiexec, 4, "stall.py", env, timeout=60)
    elapsed = time.monotonic() - began
    assert result.returncode != 0, "an uncaught StallError must end the plain mpiexec job"
    found = stalls(result.stdout)
    # the first rank to raise aborts the job (excepthook.py), so the others may not get to print
    assert found and set(found) <= {0, 1, 2}, result.stdout + result.stderr
    for waited, missing, _, message in found.values():
        assert STALL_S <= waited < STALL_S + SLACK_S, found
        assert missing == "[3]"
        assert re.match(r"allreduce #2 'step' stalled 3 s: rank 3 \(host .+\) has not arrived; "
                        r"rank 3 is at allreduce #1;", message), message
    assert elapsed < 40, f"the job took {elapsed:.0f} s: it waited for the sleeping rank"


def test_ranks_in_different_collectives_are_told_apart(mpiexec):
    """Rank 3 broadcasts while the others allreduce (same number in the group): nobody is missing, and whichever
    rank reports first says which collective the other side entered instead."""
    result = run_mpi(mpiexec, 4, "stall.py", {"MODE": "mismatch", "TACO_STALL_TIMEOUT": str(STALL_S)}, timeout=60)
    assert result.returncode != 0
    found = stalls(result.stdout)
    assert found, result.stdout + result.stderr
    for rank, (_, missing, _, message) in found.items():
        assert missing == "[]"
        expected = (r"broadcast #2 stalled 3 s: rank 0 entered allreduce #2 'step' instead" if rank == 3 else
                    r"allreduce #2 'step' stalled 3 s: rank 3 entered broadcast #2 instead")
        assert re.match(expected + r" \(the ranks run different collectives\)", message), message


@pytest.mark.parametrize("store", ["file", "tcp"])
def test_a_late_rank_fails_and_every_rank_rebuilds_the_group(mpiexec, store):
    """Rank 3 enters 6 s late. One host: it raises at once, naming the ranks that gave up. Several hosts (rank 0's
    TCPStore holds the board, which is not read on entry): its late allreduce may complete with the abandoned
    ones, and its next collective raises. Then ``taco.reinit()`` on every rank gives a working group, and the
    communication threads stuck in the abandoned allreduce are gone."""
    env = {"MODE": "recover", "STALL_S": str(STALL_S), "SLEEP_S": "6"}
    if store == "tcp":
        env["TACO_MASTER_ADDR"] = "127.0.0.1"  # the several-hosts path on one machine
    result = run_mpi(mpiexec, 4, "stall.py", env, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    found = stalls(result.stdout)
    assert all(found[r][1] == "[3]" and STALL_S <= found[r][0] < STALL_S + SLACK_S for r in (0, 1, 2)), found
    if store == "file":
        waited, missing, gave_up, message = found[3]
        assert (missing, gave_up) == ("[]", "[0, 1, 2]") and waited < STALL_S, found[3]  # at once, not a timeout later
        assert "ranks 0, 1, 2 gave up waiting at collective #2 before this rank entered it" in message
    else:  # its late allreduce met the abandoned ones (or raised naming who gave up); the next one raised.
        # With the ranks' agreement check (comm/collectives/agreement.py) its check may meet the abandoned ones' check,
        # whose
        # threads then stop before the allreduce itself: it raises at once that the collective did not complete.
        met = "NO-STALL 3" in result.stdout
        named = 3 in found and found[3][2] == "[0, 1, 2]"
        cut = 3 in found and found[3][:3] == (found[3][0], "[]", "[]") and found[3][0] < STALL_S
        assert met + named + cut == 1, result.stdout
    assert sorted(re.findall(r"STILL-BROKEN (\d)", result.stdout)) == ["0", "1", "2", "3"], result.stdout
    recovered = re.findall(r"RECOVERED (\d) (\[[\d., ]*\]) comm-threads=(\d+)", result.stdout)
    assert sorted(recovered) == [(str(r), "[6.0, 6.0, 6.0, 6.0]", "1") for r in range(4)], result.stdout


@pytest.mark.parametrize("value, expected", [(30, 30.0), ("45", 45.0), (0, 0.0), ("off", 0.0), ("None", 0.0)])
def test_configure_takes_seconds_or_off(value, expected):
    try:
        assert configure(stall_timeout=value).stall_timeout == expected
        assert settings().stall_timeout == expected
    finally:
        configure(reset=True)


@pytest.mark.parametrize("value", [-1, "soon", float("nan"), float("inf"), True])
def test_configure_refuses_a_bad_stall_timeout(value):
    with pytest.raises(ValueError, match=r"stall_timeout must be a number of seconds >= 0 \(0 or 'off' turns"):
        configure(stall_timeout=value)
    assert settings().stall_timeout == DEFAULT_STALL_TIMEOUT_S


def test_the_environment_gives_the_default(monkeypatch):
    assert stall_timeout_from_env({}) == DEFAULT_STALL_TIMEOUT_S == 300.0
    assert stall_timeout_from_env({"TACO_STALL_TIMEOUT": " off "}) == 0.0
    with pytest.raises(ValueError, match="TACO_STALL_TIMEOUT must be a number of seconds >= 0"):
        stall_timeout_from_env({"TACO_STALL_TIMEOUT": "-2"})

"""Reading rankwrap's exit markers: the one pattern the death report and the elastic watch share."""

from __future__ import annotations

from taco_notebook.cluster.processes.deaths import MARKER_LINE, death_report, died_error
from taco_notebook.engine.rankwrap import MARKER

LOG = (f"2026-11-26 05:00:00.000 [IPEngine] Registering\n"
       f"{MARKER} rank=2 host=n1 pid=4242 signal=9 elastic\n"  # an elastic cell survived it
       f"{MARKER} rank=1 host=n0 pid=4141 exitcode=3\n"
       f"{MARKER} rank=0 host=n0 pid=4040 signal=11\n")


def test_the_job_ending_death_is_the_first_marker_an_elastic_cell_did_not_survive() -> None:
    sentence, rank, host, sig = death_report(lambda: LOG, wait=0)
    assert (rank, host, sig) == (1, "n0", None)
    assert sentence == "rank 1 (host n0, pid 4141) exited with code 3"


def test_every_marker_is_read_with_whether_an_elastic_cell_survived_it() -> None:
    found = [(m.group(1), m.group(4), m.group(5), m.group(6) is not None) for m in MARKER_LINE.finditer(LOG)]
    assert found == [("2", "signal", "9", True), ("1", "exitcode", "3", False), ("0", "signal", "11", False)]


def test_a_signal_death_names_the_signal_and_no_marker_says_so() -> None:
    sentence, rank, _, sig = death_report(lambda: f"{MARKER} rank=3 host=vm pid=7 signal=9\n", wait=0)
    assert (rank, sig) == (3, "SIGKILL") and "killed by SIGKILL (killed from outside, or out of memory)" in sentence
    assert death_report(lambda: "mpiexec: exited\n", wait=0) == ("the engines' mpiexec exited unexpectedly",
                                                                None, None, None)


def test_a_death_names_every_other_ranks_fate() -> None:
    error = died_error("c", [0, 1, 2, 3, 4], {1: "finished", 4: "raised RuntimeError: Connection closed by peer"},
                       lambda: f"{MARKER} rank=2 host=vm pid=7 signal=9\n")
    assert str(error) == ("rank 2 (host vm, pid 7) killed by SIGKILL (killed from outside, or out of memory); "
                          "ranks 0, 3 stopped by MPI with it; rank 1 finished; "
                          "rank 4 raised RuntimeError: Connection closed by peer. "
                          "Cluster 'c' was shut down; the next %%taco_run starts a fresh one.")

"""The decision every rank takes when the ranks disagree on the next collective (comm/collectives/byname.py), on the
proposals real ranks send; the ranks themselves: tests/mpi/agreement.py (Horovod's duplicate-name pattern)."""

from __future__ import annotations

from taco_notebook.comm.collectives.agreement import Signature
from taco_notebook.comm.collectives.byname import Proposal, decide

BARRIER = Signature("barrier")
X = Signature("allreduce", "x", (3,), "float32", "cpu", op="sum")
X_WIDER = Signature("allreduce", "x", (4,), "float32", "cpu", op="sum")
Y = Signature("allgather", "y", (), "int64", "cpu")


def test_a_named_operation_nobody_waits_for_is_parked_where_the_others_run_something_else() -> None:
    assert decide([Proposal(X, may_park=True), Proposal(BARRIER)]) == ("park", [0])
    assert decide([Proposal(X, may_park=True), Proposal(Y, may_park=True), Proposal(BARRIER)]) == ("park", [0, 1])


def test_a_parked_operation_runs_when_every_other_rank_reaches_it() -> None:
    assert decide([Proposal(BARRIER, parked=(X,)), Proposal(X), Proposal(X, may_park=True)]) == ("run", X)


def test_a_parked_operation_does_not_run_while_a_rank_has_neither_it_nor_a_use_for_it() -> None:
    assert decide([Proposal(BARRIER, parked=(X,)), Proposal(X), Proposal(BARRIER)]) is None


def test_one_name_with_two_shapes_is_a_mismatch_wherever_it_is() -> None:
    assert decide([Proposal(X, may_park=True), Proposal(X_WIDER, may_park=True)]) is None
    assert decide([Proposal(BARRIER, parked=(X,)), Proposal(X_WIDER, may_park=True)]) is None


def test_ranks_that_cannot_wait_and_disagree_are_a_mismatch() -> None:
    assert decide([Proposal(X), Proposal(BARRIER)]) is None

"""The rank's side of the hang autopsy in this process: a real listener thread on a real Unix socket answers with
every thread's stack while those threads are blocked, from a private directory only."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from taco_notebook.comm.diagnostics import listener
from taco_notebook.remote.autopsy_reader import ask


@pytest.fixture
def private_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    directory = tmp_path / "stacks"
    monkeypatch.setenv(listener.DIR_ENV, str(directory))
    yield directory
    listener.stop_listening()


def hang_here(released: threading.Event) -> None:
    released.wait(60)


def test_the_listener_reports_a_blocked_thread_without_disturbing_it(private_dir: Path) -> None:
    released = threading.Event()
    worker = threading.Thread(target=hang_here, args=(released,), name="blocked-worker", daemon=True)
    worker.start()
    try:
        path = listener.listen()
        assert path == private_dir / f"{os.getpid()}.sock"
        assert stat.S_IMODE(os.stat(private_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        reply = ask(path, timeout=2.0)
        now = reply["now"]
        assert now["pid"] == os.getpid() and reply["at_stall"] is None
        [thread] = [t for t in now["threads"] if t["name"] == "blocked-worker"]
        functions = [frame[2] for frame in thread["frames"]]
        assert "hang_here" in functions, functions
        assert not any(t["name"] == "taco-autopsy" for t in now["threads"])  # the listener leaves itself out
        assert [t["main"] for t in now["threads"]].count(True) == 1
        assert now["place"][2] == "test_the_listener_reports_a_blocked_thread_without_disturbing_it"
        assert worker.is_alive()  # asked, not stopped
    finally:
        released.set()
        worker.join(10)
    listener.stop_listening()
    assert not path.exists()


def test_a_stall_snapshot_is_kept_for_the_next_reader(private_dir: Path) -> None:
    listener.remember_stall(7, "allreduce 'step'", 3.2)
    try:
        reply = ask(listener.listen(), timeout=2.0)
        assert reply["at_stall"]["collective"] == {"seq": 7, "name": "allreduce 'step'", "waited_s": 3.2}
        assert reply["now"]["collective"] is None
    finally:
        listener._at_stall = None


def test_a_directory_open_to_others_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "open"
    directory.mkdir(mode=0o755)
    os.chmod(directory, 0o755)
    monkeypatch.setenv(listener.DIR_ENV, str(directory))
    with pytest.raises(PermissionError, match=r"refusing the stacks directory .*open: it must be a directory of "
                                              r"uid \d+ with mode 0700 \(found drwxr-xr-x"):
        listener.listen()
    assert list(directory.iterdir()) == []


def test_no_listener_is_an_oserror(private_dir: Path) -> None:
    listener.socket_dir()
    with pytest.raises(FileNotFoundError):
        ask(listener.socket_path(1), timeout=0.5)

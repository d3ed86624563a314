"""ipyparallel's files of taco's clusters: where they live, and the sweep that removes those of an owner proven
dead (a process that really ran and ended, an earlier boot) while it keeps a live owner's and another host's."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from taco_notebook.cluster.launch import ippfiles


@pytest.fixture
def profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    return ippfiles.profile_dir()


def ipyparallel_files(profile: Path, cluster_id: str) -> list[Path]:
    """What ipyparallel writes for a cluster, by its own names."""
    paths = [profile / "security" / f"cluster-{cluster_id}.json",
             profile / "security" / f"ipcontroller-{cluster_id}-client.json",
             profile / "security" / f"ipcontroller-{cluster_id}-engine.json",
             profile / "log" / f"engines{cluster_id}.json",
             profile / "log" / f"ipcontroller-{cluster_id}-123.log",
             profile / "log" / f"ipengine-{cluster_id}-1795862482-123.log"]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    return paths


def record(profile: Path, cluster_id: str, pid: int, create_time: float, host: str | None = None,
           boot_id: str | None = None) -> None:
    path = profile / "security" / f"taco-owner-{cluster_id}.json"
    path.write_text(json.dumps({"pid": pid, "create_time": create_time, "host": host or socket.gethostname(),
                                "boot_id": boot_id or ippfiles.BOOT_ID.read_text().strip()}))
    path.chmod(0o600)


def ended_process() -> tuple[int, float]:
    """The pid and start time of a process that ran and has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    create_time = psutil.Process(proc.pid).create_time()
    proc.kill()
    proc.wait()
    return proc.pid, create_time


def test_the_profile_is_no_ipython_profile_dir(profile: Path):
    """ipyparallel's JupyterLab panel lists the ``profile_*`` directories of $IPYTHONDIR: this is not one."""
    assert profile.parent.name == "ipython" and not profile.name.startswith("profile_")


def test_a_dead_owners_files_are_swept_a_live_owners_kept(profile: Path):
    ippfiles.prepare("live-1-aaaaaa")  # this process owns it
    live = ipyparallel_files(profile, "live-1-aaaaaa")
    dead = ipyparallel_files(profile, "dead-2-bbbbbb")
    longer = ipyparallel_files(profile, "dead-2-bbbbbb-3-cccccc")  # an id that starts with the dead one's
    record(profile, "dead-2-bbbbbb", *ended_process())
    record(profile, "dead-2-bbbbbb-3-cccccc", psutil.Process().pid, psutil.Process().create_time())

    assert ippfiles.sweep() == ["dead-2-bbbbbb"]
    assert not any(path.exists() for path in dead)
    assert not (profile / "security" / "taco-owner-dead-2-bbbbbb.json").exists()
    assert all(path.exists() for path in live + longer)
    assert (profile / "security" / "taco-owner-live-1-aaaaaa.json").exists()
    assert sorted(ippfiles.remove_cluster_files("live-1-aaaaaa")) == sorted(
        [*live, profile / "security" / "taco-owner-live-1-aaaaaa.json"])


def test_an_earlier_boot_is_dead_another_host_cannot_be_judged(profile: Path):
    me = psutil.Process()
    ipyparallel_files(profile, "rebooted-4-dddddd")
    record(profile, "rebooted-4-dddddd", me.pid, me.create_time(), boot_id="00000000-another-boot")
    remote = ipyparallel_files(profile, "remote-5-eeeeee")
    record(profile, "remote-5-eeeeee", *ended_process(), host=socket.gethostname() + "-elsewhere")

    assert ippfiles.sweep() == ["rebooted-4-dddddd"]
    assert all(path.exists() for path in remote)

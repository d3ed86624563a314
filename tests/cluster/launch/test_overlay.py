"""The launch overlay: how ``--hosts n0:2,n1:2`` finds emulated nodes without production importing the emulator.

No root, no namespaces: the overlay is a file, and what the emulator publishes is computed from a saved set of
nodes (:func:`~taco_notebook.emulate.saved.nodes_from_state`, as ``status`` and ``down`` rebuild it).
Starting real nodes and running a cell over them is tests/cluster/launch/test_profiles.py's (root and sshd).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from taco_notebook.cluster.launch.overlay import (
    OVERLAY_FILE,
    LaunchOverlay,
    default_state_dir,
    overlay_for,
    read_launch_overlay,
    write_launch_overlay,
)
from taco_notebook.cluster.launch.profiles import Profile, ProfileError, hosts_profile
from taco_notebook.emulate.hosts import EmulatedHosts
from taco_notebook.emulate.saved import nodes_from_state

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's (chown) needs root")
OVERLAY = LaunchOverlay(("n0", "n1"), "/state/ssh/ssh-launcher", "10.213.7.254",
                        {"GLOO_SOCKET_IFNAME": "taco0", "UCX_TLS": "self,tcp", "UCX_NET_DEVICES": "taco0"})


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The emulator's state directory, private, and where profiles look for it (``TACO_EMULATE_DIR``)."""
    state = tmp_path / "emulated"
    os.mkdir(state, 0o700)
    monkeypatch.setenv("TACO_EMULATE_DIR", str(state))
    return state


def _emulated_hosts(state_dir: Path) -> EmulatedHosts:
    """Two started nodes as ``status`` rebuilds them from their saved state (nothing is created)."""
    nodes = nodes_from_state({"version": 1, "prefix": "taco-0abcd", "num_nodes": 2, "rate_bits_per_s": 10**9,
                              "interface": "taco0", "subnet": "10.213.7.0/24", "workdir": str(state_dir / "netns"),
                              "made": []})
    return EmulatedHosts(state_dir, nodes, 2)


def test_state_dir_is_the_emulators(state_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert default_state_dir() == state_dir
    monkeypatch.delenv("TACO_EMULATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "xdg" / "taco-notebook" / "emulated"


def test_published_and_read_back_private(state_dir: Path) -> None:
    path = write_launch_overlay(state_dir, OVERLAY)
    assert path == state_dir / OVERLAY_FILE and (os.stat(path).st_mode & 0o777) == 0o600
    assert read_launch_overlay() == OVERLAY
    assert overlay_for(["n0"]) == OVERLAY and overlay_for(["n1", "n0"]) == OVERLAY


def test_none_without_a_file_or_when_the_hosts_are_not_all_its_own(state_dir: Path, tmp_path: Path) -> None:
    assert read_launch_overlay(tmp_path / "never-made") is None
    assert read_launch_overlay() is None and overlay_for(["n0"]) is None  # the directory, no overlay: not up
    write_launch_overlay(state_dir, OVERLAY)
    assert overlay_for(["n0", "n2"]) is None
    assert overlay_for(["gpu-box"]) is None


def test_an_unsafe_directory_is_refused(state_dir: Path, tmp_path: Path) -> None:
    write_launch_overlay(state_dir, OVERLAY)
    os.chmod(state_dir, 0o777)
    with pytest.raises(ProfileError, match=r"group or others may write it.*taco_notebook emulate down"):
        read_launch_overlay()
    os.chmod(state_dir, 0o700)
    link = tmp_path / "link"
    link.symlink_to(state_dir)
    with pytest.raises(ProfileError, match="a symlink"):
        read_launch_overlay(link)


@as_root
def test_another_users_file_or_directory_is_refused(state_dir: Path) -> None:
    path = write_launch_overlay(state_dir, OVERLAY)
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(ProfileError, match=f"refusing a launch overlay: {path}: owned by uid {NOBODY}"):
        overlay_for(["n0"])
    os.chown(path, os.geteuid(), os.getegid())
    os.chown(state_dir, NOBODY, NOBODY)
    with pytest.raises(ProfileError, match="belongs to another user"):
        overlay_for(["n0"])


@pytest.mark.parametrize(("change", "words"), [
    ({"version": 2}, "not a launch overlay of version 1"),
    ({"hosts": []}, "'hosts' must be a non-empty list"),
    ({"launcher_exec": "ssh-launcher"}, "'launcher_exec' must be an absolute path"),
    ({"controller_ip": "bridge"}, "'controller_ip' must be an IP address"),
    ({"environment": {"UCX_TLS": 1}}, "'environment' must map names to strings"),
])
def test_a_damaged_overlay_names_the_field(state_dir: Path, change: dict[str, object], words: str) -> None:
    (state_dir / OVERLAY_FILE).write_text(json.dumps({**OVERLAY.to_json(), **change}))
    with pytest.raises(ProfileError, match=f"refusing the launch overlay .*{words}"):
        overlay_for(["n0"])
    (state_dir / OVERLAY_FILE).write_text("{")
    with pytest.raises(ProfileError, match="not JSON"):
        overlay_for(["n0"])


def test_the_emulator_publishes_what_the_hosts_profile_took_from_it(state_dir: Path) -> None:
    """The same profile as when profiles.py read the emulator's objects: its ssh stand-in, bridge address and
    node environment (``mpiexec_env({})``)."""
    hosts = _emulated_hosts(state_dir)
    write_launch_overlay(state_dir, hosts.launch_overlay())
    expected = Profile("hosts", (("n0", 2), ("n1", 2)), str(hosts.launcher), hosts.nodes.bridge_address,
                       hosts.mpiexec_env({}))
    assert hosts_profile("n0:2,n1:2") == expected
    assert expected.controller_ip == "10.213.7.254" and expected.environment["GLOO_SOCKET_IFNAME"] == "taco0"
    mine = hosts_profile("n0:2", launcher_exec="/usr/bin/ssh", controller_ip="10.213.7.1")  # the user's win
    assert (mine.launcher_exec, mine.controller_ip, mine.environment) == ("/usr/bin/ssh", "10.213.7.1",
                                                                          hosts.mpiexec_env({}))
    real = hosts_profile("localhost:2")  # not an emulated node: ssh on PATH, the route's address, no environment
    assert (real.launcher_exec, real.controller_ip, real.environment) == (None, "127.0.0.1", {})

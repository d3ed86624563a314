"""The magics' settings: each an option, a ``TacoMagics`` trait (``%config``) and an environment variable, the option
winning over the trait and the trait over the environment; bad values of any of them are a clear error before
anything starts.

Real IPython shell (``%config`` is IPython's own magic), real MPI-launched engines for what the ranks see.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from IPython.core.error import UsageError

from taco_notebook.cluster.session import clusters
from taco_notebook.comm.compression.spec import CompressionSpec
from taco_notebook.plan.settings import TacoSettings

from ..conftest import assert_trait_refused, session_processes

pytestmark = pytest.mark.cluster

TRAITS = sorted(TacoSettings.class_trait_names(config=True))


@pytest.fixture
def magics(ip: Any) -> Iterator[Any]:
    """The shell's TacoMagics; every trait unset again afterwards (the shell lives for the whole session)."""
    found = ip.magics_manager.registry["TacoMagics"]
    yield found
    found.config.pop("TacoMagics", None)  # or the next %config would load these values again
    for name in TRAITS:
        setattr(found, name, None)


def config(ip: Any, line: str) -> None:
    ip.run_line_magic("config", line)


# ---------------------------------------------------------------- %config in a real shell

def test_every_setting_is_a_trait_listed_by_config(ip, magics, capsys):
    assert TRAITS == ["algorithm", "collective_timeout", "compression", "controller_ip", "dashboard", "fusion_mb",
                      "gpus", "gpus_per_node", "hostfile", "hosts", "intra_size", "link_gbits", "max_ranks",
                      "mpi_launcher", "nodes", "np", "output", "partition", "profile", "queue_timeout",
                      "require_hugepages", "shm", "stall_timeout", "time", "timeout"]
    config(ip, "TacoMagics")
    listed = capsys.readouterr().out
    for name in TRAITS:
        assert f"TacoMagics.{name}=" in listed
    assert "TACO_LINK_GBITS" in listed and "TACO_DASHBOARD" in listed and "LIGHT_2D_ALLREDUCE" in listed


def test_config_sets_traits_in_their_canonical_form(ip, magics):
    config(ip, 'TacoMagics.compression = "TopK:0.01"')
    config(ip, 'TacoMagics.algorithm = "2D"')
    config(ip, 'TacoMagics.dashboard = "Text"')
    config(ip, "TacoMagics.fusion_mb = 8")
    config(ip, "TacoMagics.shm = False")
    assert (magics.compression, magics.algorithm, magics.dashboard) == ("topk:0.01", "2d", "text")
    assert magics.fusion_mb == 8.0 and magics.shm is False
    assert magics.link_gbits is None  # unset: the environment decides when a cell runs


@pytest.mark.parametrize("line, message", [
    ('TacoMagics.compression = "gzip"', "TacoMagics.compression: unknown compression 'gzip'; use none, fp16, bf16"),
    ('TacoMagics.algorithm = "3d"', "TacoMagics.algorithm: unknown algorithm '3d'; use auto, flat, 2d"),
    ('TacoMagics.dashboard = "fancy"', "TacoMagics.dashboard must be one of auto, widget, text, off, got 'fancy'"),
    ('TacoMagics.gpus = "many"', "TacoMagics.gpus must be one of auto, exclusive, shared, none, got 'many'"),
    ('TacoMagics.mpi_launcher = "fork"', "TacoMagics.mpi_launcher must be one of auto, hydra, gforker"),
    ("TacoMagics.np = 0", "TacoMagics.np must be a positive integer (ranks), got 0"),
    ("TacoMagics.intra_size = -2", "TacoMagics.intra_size must be a positive integer (ranks per node), got -2"),
    ("TacoMagics.link_gbits = -1", "TacoMagics.link_gbits must be a positive number of Gbit/s, got -1"),
    ("TacoMagics.fusion_mb = -1", "TacoMagics.fusion_mb must be a number of megabytes >= 0, got -1.0"),
    ("TacoMagics.collective_timeout = 0", "TacoMagics.collective_timeout must be a positive number of seconds"),
    ("TacoMagics.stall_timeout = -1", "TacoMagics.stall_timeout must be a number of seconds >= 0 (0 or 'off'"),
    ("TacoMagics.require_hugepages = 0",
     "TacoMagics.require_hugepages must be a positive integer (free huge pages per node), got 0"),
])
def test_a_bad_trait_value_is_refused_naming_the_trait_and_the_choices(ip, magics, caplog, line, message):
    assert_trait_refused(ip, caplog, line, message, (line.split("=")[0].strip().split(".")[1],))


# ---------------------------------------------------------------- env -> trait -> option

def test_kernel_side_settings_env_then_trait_then_option(ip, magics, monkeypatch):
    monkeypatch.setenv("TACO_LINK_GBITS", "25")
    monkeypatch.setenv("TACO_DASHBOARD", "text")
    assert magics._link_capacity(None) == 25e9 / 8 and magics._dashboard_mode(None) == "text"
    config(ip, "TacoMagics.link_gbits = 10")
    config(ip, 'TacoMagics.dashboard = "off"')
    assert magics._link_capacity(None) == 10e9 / 8 and magics._dashboard_mode(None) == "off"
    assert magics._link_capacity("40") == 40e9 / 8 and magics._dashboard_mode("widget") == "widget"
    monkeypatch.setenv("TACO_LINK_GBITS", "slow")  # a set trait does not read the environment at all
    assert magics._link_capacity(None) == 10e9 / 8


def test_the_ranks_get_the_compression_spec_as_a_value():
    """The trait holds the spec's canonical text; what ``%%taco_run`` sends the ranks is the parsed value."""
    from types import SimpleNamespace

    from taco_notebook.engine.wire import CellSettings
    from taco_notebook.plan.resolve import comm_settings

    config = TacoSettings()
    config.compression = " TopK:0.01"
    args = SimpleNamespace(algorithm=None, compression=None, fusion_mb=None, stall_timeout=None)
    assert config.compression == "topk:0.01"
    assert comm_settings(config, args) == CellSettings(compression=CompressionSpec("topk", 0.01))
    args.compression = "powersgd:2:warmup=0"
    args.fusion_mb = "8"
    assert comm_settings(config, args) == CellSettings(compression=CompressionSpec("powersgd", rank=2, warmup=0),
                                                       fusion_mb=8.0)
    args.compression = "AUTO"
    assert comm_settings(config, args) == CellSettings(auto_compression=True, fusion_mb=8.0)
    config.compression = None
    args.compression = args.fusion_mb = None
    assert comm_settings(config, args) is None  # nothing given: the ranks keep their own settings


def test_rank_settings_env_then_trait_then_option_on_real_ranks(ip, magics, shared_cluster, monkeypatch):
    cell = "s = taco.settings()\n(s.compression, s.algorithm, s.fusion_mb)"
    defaults = ip.run_cell_magic("taco_run", "", cell)  # the ranks' own environment
    config(ip, 'TacoMagics.compression = "fp16"')
    config(ip, "TacoMagics.fusion_mb = 8")
    assert ip.run_cell_magic("taco_run", "", cell) == (CompressionSpec("fp16"), defaults[1], 8.0)
    assert ip.run_cell_magic("taco_run", "--compression bf16 --fusion-mb 2", cell) == (CompressionSpec("bf16"),
                                                                                       defaults[1], 2.0)
    config(ip, "TacoMagics.compression = None")
    config(ip, "TacoMagics.fusion_mb = None")
    assert ip.run_cell_magic("taco_run", "", cell) == defaults


def test_cluster_settings_trait_then_option_restart_and_reach_the_ranks(ip, magics, capsys):
    cell = "s = taco.settings()\n(taco.size(), s.shm, s.collective_timeout)"
    config(ip, "TacoMagics.np = 2")
    config(ip, "TacoMagics.shm = False")
    config(ip, "TacoMagics.collective_timeout = 45")
    config(ip, 'TacoMagics.mpi_launcher = "hydra"')
    try:
        assert ip.run_cell_magic("taco_run", "--cluster knobs", cell) == (2, False, 45.0)
        cluster = clusters["knobs"]
        assert cluster.mpi.launcher == "hydra"
        assert (cluster.env["TACO_SHM"], cluster.env["TACO_COLLECTIVE_TIMEOUT"]) == ("0", "45.0")
        pids = [r.pid for r in cluster.ranks]
        assert ip.run_cell_magic("taco_run", "--cluster knobs", cell) == (2, False, 45.0)
        assert [r.pid for r in clusters["knobs"].ranks] == pids  # the same settings reuse the cluster
        capsys.readouterr()
        assert ip.run_cell_magic("taco_run", "--cluster knobs --shm --collective-timeout 60", cell) == (
            2, True, 60.0)
        err = capsys.readouterr().err
        assert "cluster 'knobs' uses shared memory otherwise; restarting it with --shm" in err
    finally:
        ip.run_line_magic("taco_cluster", "stop --cluster knobs")


# ---------------------------------------------------------------- bad values start nothing

@pytest.mark.parametrize("line, message", [
    ("--dashboard fancy", "--dashboard must be one of auto, widget, text, off, got 'fancy'"),
    ("--link-gbits fast", "--link-gbits must be a positive number of Gbit/s, got 'fast'"),
    ("--collective-timeout 0", "--collective-timeout must be a positive number of seconds, got '0'"),
    ("--mpi-launcher fork", "--mpi-launcher must be one of auto, hydra, gforker, got 'fork'"),
    ("--gpus many", "--gpus must be one of auto, exclusive, shared, none, got 'many'"),
    ("--timeout soon", "--timeout must be a positive number of seconds, got 'soon'"),
    ("--stall-timeout soon", "--stall-timeout must be a number of seconds >= 0 (0 or 'off' turns the stall "
                             "watchdog off), got 'soon'"),
    ("--stall-timeout -3", "--stall-timeout must be a number of seconds >= 0"),
])
def test_a_bad_option_is_a_usage_error_and_starts_nothing(ip, magics, line, message):
    before, names = set(session_processes()), set(clusters)
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("taco_run", f"-np 2 --cluster never {line}", "print('never runs')")
    assert message in str(info.value)
    assert set(clusters) == names and set(session_processes()) <= before


@pytest.mark.parametrize("variable, value, message", [
    ("TACO_MPI_LAUNCHER", "fork", "TACO_MPI_LAUNCHER='fork' is not a launcher: set it to one of auto, hydra"),
    ("TACO_SHM", "maybe", "TACO_SHM must be 1/true/yes/on or 0/false/no/off, got 'maybe'"),
    ("TACO_COLLECTIVE_TIMEOUT", "-5", "TACO_COLLECTIVE_TIMEOUT must be a number of seconds > 0, got -5.0"),
    ("TACO_FUSION_MB", "lots", "TACO_FUSION_MB must be a number of megabytes >= 0, got 'lots'"),
    ("TACO_STALL_TIMEOUT", "never", "TACO_STALL_TIMEOUT must be a number of seconds >= 0 (0 or 'off'"),
    ("LIGHT_2D_ALLREDUCE", "sometimes", "LIGHT_2D_ALLREDUCE must be 1/true/yes/on or 0/false/no/off"),
])
def test_a_bad_environment_value_is_a_usage_error_and_starts_nothing(ip, magics, monkeypatch, variable, value,
                                                                     message):
    monkeypatch.setenv(variable, value)
    before, names = set(session_processes()), set(clusters)
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("taco_run", "-np 2 --cluster never", "pass")
    assert message in str(info.value)
    assert set(clusters) == names and set(session_processes()) <= before


def test_the_max_ranks_trait_limits_and_says_how_to_raise_it(ip, magics):
    config(ip, "TacoMagics.max_ranks = 2")
    before, names = set(session_processes()), set(clusters)
    with pytest.raises(UsageError, match=r"-np 3 is over the limit of 2 ranks .*%config TacoMagics.max_ranks = N"):
        ip.run_cell_magic("taco_run", "-np 3 --cluster capped", "pass")
    with pytest.raises(UsageError, match=r"-n 3 is over the limit of 2 ranks"):
        ip.run_line_magic("taco_cluster", "start -n 3 --cluster capped")
    config(ip, "TacoMagics.np = 3")  # the default size is held to the limit too
    with pytest.raises(UsageError, match=r"-np 3 is over the limit of 2 ranks"):
        ip.run_line_magic("taco_cluster", "start --cluster capped")
    assert set(clusters) == names and set(session_processes()) <= before


def test_help_names_the_traits_and_the_environment(ip, capsys):
    ip.run_cell("%taco_run --help")
    out = capsys.readouterr().out
    for part in ("--shm", "--no-shm", "--collective-timeout", "--mpi-launcher", "--dashboard MODE",
                 "--link-gbits", "TacoMagics.compression", "TACO_LINK_GBITS", "TACO_MPI_LAUNCHER",
                 "%config TacoMagics"):
        assert part in out, part


def test_a_cells_settings_become_configures_arguments_as_values():
    """What the ranks pass to ``taco.configure``: each given setting as its value (the spec stays a spec), auto
    replaced by what auto chose, nothing for a setting not given."""
    from taco_notebook.engine.wire import CellSettings

    spec = CompressionSpec("topk", 0.01)
    assert CellSettings(algorithm="flat", compression=spec).configure_kwargs() == {"algorithm": "flat",
                                                                                   "compression": spec}
    chosen = CompressionSpec("fp16")
    assert CellSettings(auto_compression=True, fusion_mb=8.0).configure_kwargs(auto=chosen) == {
        "compression": chosen, "fusion_mb": 8.0}
    with pytest.raises(ValueError, match="either a spec or auto"):
        CellSettings(compression=spec, auto_compression=True)

"""The option table: the one declaration the magics' flags, the traits, the ``launch`` parser and ``docs/options.md``
are made from, so that they cannot drift apart (the traits' help once omitted powersgd and mpijob)."""

from __future__ import annotations

import argparse

import pytest

from taco_notebook.cluster.launch.mpi import LAUNCHERS
from taco_notebook.cluster.launch.profiles import PROFILES
from taco_notebook.comm.group.placement import GPU_MODES
from taco_notebook.comm.specs import ALGORITHMS
from taco_notebook.plan import checks
from taco_notebook.plan.options import (
    COMPRESSION_FORMS,
    DASHBOARD_MODES,
    EFFECTS,
    OPTIONS,
    add_arguments,
    flags_of,
    markdown,
    option,
    traits,
)
from taco_notebook.plan.settings import TacoSettings

from ..conftest import REPO

CHOICES = {"profile": PROFILES, "gpus": GPU_MODES, "mpi_launcher": LAUNCHERS, "algorithm": ALGORITHMS,
           "dashboard": DASHBOARD_MODES}


def test_the_committed_reference_page_is_what_the_table_renders() -> None:
    committed = (REPO / "docs" / "options.md").read_text()
    assert committed == markdown(), ("docs/options.md is stale: run `python -m taco_notebook.plan.options > "
                                     "docs/options.md` and commit it")


def test_every_option_is_in_the_reference_page() -> None:
    page = markdown()
    for row in OPTIONS:
        assert f"**{row.name}**" in page
        for flag in row.flags:
            assert flag.help in page


@pytest.mark.parametrize("name", sorted(CHOICES))
def test_help_of_a_choice_names_every_choice(name: str) -> None:
    row = option(name)
    for choice in CHOICES[name]:
        assert choice in row.trait_help, f"TacoMagics.{name}'s help omits {choice!r}: {row.trait_help!r}"
        assert any(choice in flag.help for flag in row.flags), f"--{name}'s help omits {choice!r}"


def test_the_compression_help_names_every_spec_and_each_is_accepted() -> None:
    for form in COMPRESSION_FORMS:
        assert form in option("compression").trait_help and form in option("compression").flags[0].help
        spec = form.replace("RATIO", "0.01").replace("RANK", "4")
        assert checks.compression(spec, "--compression").startswith(spec.split(":")[0])


def test_the_dashboard_modes_are_the_widgets() -> None:
    from taco_notebook.widgets.dashboard import DASHBOARD_MODES as WIDGET_MODES

    assert DASHBOARD_MODES == WIDGET_MODES


def test_a_flag_of_a_trait_names_the_trait_and_its_variable() -> None:
    for row in traits():
        if not row.flags:
            continue
        helps = " ".join(flag.help for flag in row.flags)
        assert f"TacoMagics.{row.name}" in helps, row.name
        assert row.env is None or row.env in helps, row.name


def test_the_traits_are_the_rows_with_a_trait() -> None:
    assert sorted(TacoSettings.class_trait_names(config=True)) == sorted(row.name for row in traits())
    for row in traits():
        assert TacoSettings.class_traits()[row.name].help == row.trait_help
        assert row.check is not None, f"TacoMagics.{row.name} has no check"
    assert {row.effect for row in OPTIONS} <= set(EFFECTS)


def test_launch_takes_the_run_flags_and_the_cluster_stack_is_a_part_of_them() -> None:
    parser = add_arguments(argparse.ArgumentParser())
    spelled = {s for action in parser._actions for s in action.option_strings}
    run = {s for _, flag in flags_of("run") for s in flag.spellings if s.startswith("-")}
    assert spelled - {"-h", "--help"} == run
    assert {s for _, flag in flags_of("cluster") for s in flag.spellings} < run
    args = parser.parse_args(["--no-shm", "--no-dashboard", "--no-stream", "train.py", "-np", "3"])
    assert (args.shm, args.dashboard, args.stream, args.gather, args.cluster) == (False, "off", False, False, "default")
    assert (args.script, args.script_args, args.np) == ("train.py", ["-np", "3"], None)


def test_compression_auto_is_accepted_and_named_in_a_bad_specs_message() -> None:
    assert checks.compression(" AUTO ", "--compression") == "auto"
    assert "auto" in option("compression").trait_help
    with pytest.raises(ValueError, match=r"unknown compression 'zip'.*, or auto \(taco.tune's choice\)"):
        checks.compression("zip", "--compression")


def test_output_auto_shows_every_rank_up_to_32_and_says_once_when_it_shows_rank_0s_only(monkeypatch):
    import io

    from taco_notebook.plan.output import RankOutput
    from taco_notebook.plan.runplan import output_mode
    from taco_notebook.plan.settings import TacoSettings

    monkeypatch.delenv("TACO_OUTPUT", raising=False)
    out = io.StringIO()
    say = RankOutput(stdout=out, stderr=out)
    config = TacoSettings()
    assert output_mode(config, None, 32, "c-small", say) == "all"
    assert output_mode(config, None, 33, "c-big", say) == "rank0"
    assert output_mode(config, None, 1000, "c-big", say) == "rank0"
    assert out.getvalue().count("showing rank 0's output") == 1, out.getvalue()  # once per cluster
    assert output_mode(config, "all", 1000, "c-big", say) == "all"
    monkeypatch.setenv("TACO_OUTPUT", "errors")
    assert output_mode(config, None, 4, "c-env", say) == "errors"
    monkeypatch.setenv("TACO_OUTPUT", "loud")
    with pytest.raises(Exception, match="TACO_OUTPUT"):
        output_mode(config, None, 4, "c-env", say)

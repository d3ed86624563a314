"""The ``slurm`` profile's options, queue state and Slurm commands, usable anywhere (doctor, server, CLI).

The profile has two ways in, both through ipyparallel's own launchers (:mod:`.launchers`): inside an allocation
(``SLURM_JOB_ID`` set: the kernel runs under ``salloc`` or in a batch job) the engines are an ``srun
--mpi=pmi2`` job step of it (:class:`~.launchers.SrunEngineSetLauncher`), so Slurm's PMI2 server gives the mpich
wheel its ranks and engine id = MPI rank = Slurm task id; outside one (a login node) they are an ``sbatch`` job
shaped by :class:`SlurmOptions` (:class:`~.launchers.SlurmBatchEngineSetLauncher`).
:func:`~.launchers.engine_launcher` picks the class, :func:`~.launchers.configure` writes its traitlets config.
The launchers subclass ipyparallel's, which imports IPython; this module imports neither.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

from ....errors import ClusterStartError

__all__ = ["SlurmError", "SlurmOptions", "JobState", "in_allocation", "job_state", "require_command",
           "run_slurm_command", "TERMINAL_STATES", "SRUN_ARGS", "check_time", "check_partition", "check_count",
           "TIME_FORMATS"]

JOB_ENV = "SLURM_JOB_ID"
# mpich (the wheel, and most site MPICHs) takes its ranks from Slurm's PMI2 server; pmix is not built everywhere.
SRUN_ARGS = ("--mpi=pmi2",)
# squeue's long state names of a job that will never run (again).
TERMINAL_STATES = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                             "OUT_OF_MEMORY", "PREEMPTED", "REVOKED", "SPECIAL_EXIT", "TIMEOUT"})
# sbatch's --time forms (minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]]).
TIME_FORMATS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
_TIME = re.compile(r"(?:(\d+)-(\d{1,2})(?::(\d{1,2})(?::(\d{1,2}))?)?|(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?)")
HINT = ("run this where Slurm's client commands are installed (a login node, or `module load slurm`), "
        "or use --profile local")


class SlurmError(ClusterStartError):
    """Slurm refused, lost or cancelled the engines' job, or is not there at all."""


@dataclass(frozen=True)
class SlurmOptions:
    """What the user asks Slurm for. Empty strings and 0 mean "Slurm's default"; ``n`` is the engine count.

    ``queue_timeout``: seconds a submitted job may wait in the queue before it is cancelled (None: no limit).
    ``sbatch_args``: further ``#SBATCH`` options, one per item (``["--exclusive", "--account=proj"]``).
    """

    partition: str = ""
    time: str = ""
    nodes: int = 0
    gpus_per_node: int = 0
    queue_timeout: float | None = None
    sbatch_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            check_count(getattr(self, name), name.replace("_", "-"))
        if self.queue_timeout is not None and self.queue_timeout <= 0:
            raise ValueError(f"queue timeout must be a positive number of seconds, got {self.queue_timeout!r}")
        if self.partition:
            check_partition(self.partition)
        if self.time:
            check_time(self.time)
        if any("\n" in arg for arg in self.sbatch_args):
            raise ValueError("sbatch options are one line each")

    def flags(self) -> str:
        """These options as the magics' flags (``--partition gpu --time 30``), for messages; "" when all default."""
        given = [("--partition", self.partition), ("--time", self.time), ("--nodes", self.nodes),
                 ("--gpus-per-node", self.gpus_per_node), ("--queue-timeout", self.queue_timeout)]
        return " ".join(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
                        for flag, value in given if value not in ("", 0, None))

    def directives(self) -> list[str]:
        """The ``#SBATCH`` lines these options add (partition and time go through ipyparallel's own)."""
        lines = [f"#SBATCH --nodes={self.nodes}"] if self.nodes else []
        if self.gpus_per_node:
            lines.append(f"#SBATCH --gres=gpu:{self.gpus_per_node}")
        return lines + [f"#SBATCH {arg}" for arg in self.sbatch_args]


def check_partition(text: str, what: str = "--partition") -> str:
    """``text`` stripped when it is a partition name (no spaces: it goes on an ``#SBATCH`` line), else a ValueError."""
    name = str(text).strip()
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"{what} must be a Slurm partition name (no spaces), got {text!r}")
    return name


def check_count(value: object, what: str) -> int:
    """``value`` (an int or its text) as a whole number >= 0 (0: Slurm's default, or none), else a ValueError."""
    try:
        number = -1 if isinstance(value, bool | float) else int(str(value).strip())
    except ValueError:
        number = -1
    if number < 0:
        raise ValueError(f"{what} must be a whole number >= 0 (0: none), got {value!r}")
    return number


def check_time(text: str, what: str = "--time") -> str:
    """``text`` when it is one of Slurm's time limits (:data:`TIME_FORMATS`; minutes and seconds below 60 after
    the first field, hours below 24 after a day count), else a ValueError naming ``what`` and the forms, so a
    typo is refused before sbatch sees it (sbatch would refuse it only once the controller is up)."""
    match = _TIME.fullmatch(str(text).strip())
    if match is not None:
        days, hours, *rest = match.groups()
        later = [int(field) for field in rest if field is not None][1 if days is None else 0:]
        if all(field < 60 for field in later) and (days is None or int(hours) < 24):
            return str(text).strip()
    raise ValueError(f"{what} {text!r} is not a Slurm time limit: give {TIME_FORMATS} (for example 30, 1:30:00 "
                     f"or 2-00)")


@dataclass(frozen=True)
class JobState:
    """One ``squeue`` answer: long state name, reason (pending jobs), node list (running jobs)."""

    job_id: str
    state: str
    reason: str = ""
    nodes: str = ""

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES or self.state == "GONE"

    def describe(self) -> str:
        """``job 12 PENDING (Resources)``, ``job 12 RUNNING on n[0-1]``, ``job 12 CANCELLED``."""
        if self.state == "RUNNING" and self.nodes:
            return f"job {self.job_id} RUNNING on {self.nodes}"
        # A cancelled or completed job keeps its last pending reason ("BeginTime"): only noise then.
        shown = self.reason and self.reason != "None" and self.state not in ("CANCELLED", "COMPLETED")
        reason = f" ({self.reason})" if shown else ""
        return f"job {self.job_id} {self.state}{reason}"


def in_allocation(environ: Mapping[str, str] | None = None) -> str | None:
    """The id of the Slurm allocation this process runs in (``SLURM_JOB_ID``), or None."""
    return (os.environ if environ is None else environ).get(JOB_ENV) or None


def require_command(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The path of Slurm's ``name`` (sbatch, srun, ...) on PATH, or a :class:`SlurmError` that says what to do."""
    found = shutil.which(name, path=(os.environ if environ is None else environ).get("PATH"))
    if found is None:
        raise SlurmError(f"{name} not found on PATH: {HINT}")
    return found


def run_slurm_command(args: list[str], env: Mapping[str, str] | None = None, timeout: float = 60) -> str:
    """Run a Slurm client command; its stdout, or a :class:`SlurmError` carrying Slurm's own message."""
    require_command(args[0], env)
    try:
        done = subprocess.run(args, env=None if env is None else dict(env), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(args)}` did not answer in {timeout:.0f} s: is slurmctld reachable "
                         f"(`scontrol ping`)?") from None
    if done.returncode != 0:
        message = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}")
        raise SlurmError(f"{os.path.basename(args[0])} failed: {message}")
    return done.stdout


def job_state(job_id: str, env: Mapping[str, str] | None = None) -> JobState:
    """The job's state from ``squeue`` (finished jobs too, while slurmctld remembers them; ``GONE`` after)."""
    try:
        out = run_slurm_command(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T|%r|%N"], env, timeout=30)
    except SlurmError as exc:
        if "Invalid job id" in str(exc):  # purged from slurmctld's memory (MinJobAge): long finished
            return JobState(job_id, "GONE")
        raise
    line = out.strip().splitlines()[0] if out.strip() else ""
    if not line:
        return JobState(job_id, "GONE")
    state, reason, nodes = (line.split("|") + ["", ""])[:3]
    return JobState(job_id, state.strip(), reason.strip(), nodes.strip())

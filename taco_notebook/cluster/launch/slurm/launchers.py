"""The slurm profile's two engine launchers, both ipyparallel's own with a notebook's needs added.

:class:`SrunEngineSetLauncher` (inside an allocation) is ``MPIEngineSetLauncher`` with ``srun --mpi=pmi2`` for
``mpiexec``. :class:`SlurmBatchEngineSetLauncher` (outside one) is ``SlurmEngineSetLauncher``, the engines as
an ``sbatch`` job.

For the batch job ipyparallel writes the script and runs ``sbatch``/``scancel``; the subclass adds

* the job's shape from :class:`~taco_notebook.cluster.launch.slurm.options.SlurmOptions` (``#SBATCH --nodes``,
  ``--gres=gpu:N`` when N > 0, extra lines; partition and time through ipyparallel's own ``queue`` and
  ``timelimit``), and ``srun --mpi=pmi2`` in the script so that the engines are MPI ranks (engine id = MPI rank =
  Slurm task id);
* Slurm's own message when sbatch rejects the job (ipyparallel's ``check_output`` loses stderr);
* a watcher thread that reports the job id and each change of its queue state through ``progress``
  ("job 12 PENDING (Resources)", "job 12 RUNNING on n0"), cancels a job that waits longer than
  ``queue_timeout``, and records in :attr:`failure` a job that ended while the cluster still expected it;
* ``stop``: ``scancel``, then wait until squeue shows the job finished, so nothing of it is left running.

The script is written to ``<profile>/slurm/`` (0700), not to the notebook's working directory.

:func:`wait_for_engines` is what a cluster start waits on: it raises the job's failure at once, waits as long
as the queue does (``queue_timeout``), and gives the engines ``timeout`` seconds from the moment the job runs.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from traitlets import Any as AnyTrait
from traitlets import Float, List, Unicode, default

from ....ipp.upstream import MPIEngineSetLauncher, SlurmEngineSetLauncher, shlex_join
from .options import (
    SRUN_ARGS,
    JobState,
    SlurmError,
    SlurmOptions,
    in_allocation,
    job_state,
    require_command,
    run_slurm_command,
)

__all__ = ["SlurmBatchEngineSetLauncher", "SrunEngineSetLauncher", "wait_for_engines", "engine_launcher", "configure"]

_ALREADY_OVER = ("already completing or completed", "Invalid job id")
_WHY = {"CANCELLED": "cancelled outside taco: scancel, an administrator, or preemption",
        "COMPLETED": "the engines exited by themselves", "FAILED": "an engine task failed: see the job's output",
        "TIMEOUT": "the job reached its time limit: ask for a longer --time",
        "NODE_FAIL": "a node of the job failed", "OUT_OF_MEMORY": "a task ran out of memory"}


class SrunEngineSetLauncher(MPIEngineSetLauncher):
    """Engines as one ``srun`` job step of the allocation this kernel runs in (``SLURM_JOB_ID`` set).

    ipyparallel's MPI launcher with ``srun`` for ``mpiexec``: ``srun -n N --mpi=pmi2 ENGINE --mpi``. Stopping it
    signals ``srun``, which forwards the signal to every task and ends the step (not the allocation).
    """

    mpi_cmd = List(["srun"], config=True, help="The srun command (and its path) that starts the engines' step")
    mpi_args = List(list(SRUN_ARGS), config=True, help="srun options after -n N")

    def start(self, n: int) -> Any:
        require_command(self.mpi_cmd[0], {**os.environ, **self.get_env()})
        if in_allocation() is None:
            raise SlurmError("srun engines need a Slurm allocation (SLURM_JOB_ID is not set): start the notebook "
                             "under salloc/sbatch, or let taco submit a job (outside an allocation)")
        return super().start(n)



class SlurmBatchEngineSetLauncher(SlurmEngineSetLauncher):
    """Submit the engines as one Slurm job of ``n`` tasks; report its queue state; cancel it on stop."""

    default_template = Unicode("""#!/bin/sh
#SBATCH --export=ALL
#SBATCH --job-name=ipengine-{cluster_id}
srun {srun_args} {program_and_args}
""")
    srun_args = List(Unicode(), list(SRUN_ARGS), config=True, help="srun options in the batch script")
    directives = List(Unicode(), config=True, help="extra #SBATCH lines (nodes, gres, ...), whole lines")
    queue_timeout = Float(None, allow_none=True, config=True,
                          help="seconds the job may stay PENDING before it is cancelled (None: no limit)")
    poll_interval = Float(1.0, config=True, help="seconds between squeue polls")
    stop_timeout = Float(60.0, config=True, help="seconds to wait after scancel for the job to end")
    progress = AnyTrait(None, allow_none=True, config=True, help="callable(str) for queue-state lines")
    failure = Unicode("", help="why the job ended before it was stopped (empty while all is well)")

    @default("program")
    def _default_program(self) -> list[str]:
        return list(self.engine_cmd) + ["--mpi"]  # engine id = MPI rank, as MPIEngineSetLauncher does

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        folder = os.path.join(self.profile_dir or ".", "slurm")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        self.batch_file = os.path.join(folder, f"engines-{self.cluster_id or 'default'}-{self.engine_set_id}.sbatch")
        self.context["srun_args"] = shlex_join(self.srun_args)
        self.job: JobState | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def _insert_job_array_in_script(self) -> None:
        # After ipyparallel's "#SBATCH --ntasks={n}": its test for an existing --ntasks/-n line also matches
        # "#SBATCH --nodes=2" ("-n" + "odes"), and the job would silently get one task.
        super()._insert_job_array_in_script()
        if self.directives:
            template: str = self.batch_template  # type: ignore[has-type]
            first, rest = template.split("\n", 1)
            self.batch_template = "\n".join([first, *self.directives, rest])

    def _run_command(self, command: list[str], **kwargs: Any) -> str:
        env = kwargs.get("env")
        return run_slurm_command(list(command), env)

    def _report(self, line: str) -> None:
        if callable(self.progress):
            self.progress(line)
        else:
            self.log.info(line)

    def start(self, n: int = 1) -> str:
        """Submit the job (a :class:`SlurmError` with sbatch's message if it is refused) and start watching it."""
        env = {**os.environ, **self.get_env()}
        require_command(self.submit_command[0], env)
        self.context["srun_args"] = shlex_join(self.srun_args)
        try:
            job_id = str(super().start(n))
        except SlurmError as exc:
            raise SlurmError(f"Slurm rejected the engines' job ({n} tasks): {exc}") from None
        self._report(f"job {job_id} submitted: {n} engine tasks")
        self._watcher = threading.Thread(target=self._watch, name=f"slurm-job-{job_id}", daemon=True)
        self._watcher.start()
        return job_id

    def _watch(self) -> None:
        submitted = time.monotonic()
        last = ""
        while not self._stopping.wait(self.poll_interval):
            try:
                state = job_state(self.job_id)
            except SlurmError as exc:  # slurmctld busy or restarting: say so, keep watching
                self.log.warning("squeue for job %s: %s", self.job_id, exc)
                continue
            self.job = state
            if state.describe() != last and not self._stopping.is_set():
                last = state.describe()
                self._report(last)
            if self._stopping.is_set():
                return
            if state.finished:
                self._ended(f"{state.describe()} before the cluster was stopped ({_WHY.get(state.state, state.state)})")
                return
            waited = time.monotonic() - submitted
            if state.state == "PENDING" and self.queue_timeout is not None and waited > self.queue_timeout:
                self._cancel()
                self._report(f"job {self.job_id} CANCELLED: queue timeout")
                self._ended(f"{state.describe()} for {waited:.0f} s (queue timeout {self.queue_timeout:g} s): "
                            f"cancelled it; ask for fewer nodes or GPUs, another partition, or a longer timeout")
                return

    def _ended(self, why: str) -> None:
        self.failure = why
        state = self.job.state if self.job else ""
        self.notify_stop({"job_id": self.job_id, "state": state, "failure": why,
                          "exit_code": 0 if state == "COMPLETED" else 1})  # ipyparallel logs the output if != 0

    def _cancel(self) -> str:
        try:
            return self._run_command([*self.delete_command, self.job_id])
        except SlurmError as exc:
            if any(text in str(exc) for text in _ALREADY_OVER):
                return str(exc)
            raise

    def stop(self) -> str:
        """``scancel`` the job and wait (``stop_timeout``) until squeue shows it finished."""
        self._stopping.set()
        if not self.job_id:
            return ""
        output = self._cancel()
        deadline = time.monotonic() + self.stop_timeout
        state = job_state(self.job_id)
        while not state.finished and time.monotonic() < deadline:
            time.sleep(0.25)
            state = job_state(self.job_id)
        self.job = state
        if not state.finished:
            raise SlurmError(f"{state.describe()} {self.stop_timeout:.0f} s after scancel: see `scontrol show job "
                             f"{self.job_id}` and the node's slurmd log")
        self._report(state.describe())
        if self._watcher is not None:
            self._watcher.join(timeout=self.poll_interval + 30)
        self.notify_stop({"job_id": self.job_id, "state": state.state, "output": output})
        return output


def _output_tail(launcher: Any, lines: int = 15) -> str:
    """The job's output so far: its file while it runs; ipyparallel's copy once it has taken the file away
    (notify_stop reads and removes it)."""
    try:
        with open(launcher.output_file, errors="replace") as f:
            text = f.read()
    except OSError:
        text = launcher.get_output(remove=False) or ""
    return "\n".join(text.strip().splitlines()[-lines:])


def wait_for_engines(client: Any, launcher: Any, n: int, timeout: float = 120.0) -> None:
    """Wait until ``n`` engines have registered with ``client``.

    Raises :class:`SlurmError` as soon as the job has failed (``launcher.failure``), and when the job has been
    RUNNING for ``timeout`` seconds with fewer engines (the job's output tail attached). The time in the queue
    is bounded by the launcher's ``queue_timeout``, not by ``timeout``.
    """
    running_since: float | None = None
    while len(client.ids) < n:
        if getattr(launcher, "failure", ""):
            tail = _output_tail(launcher)
            raise SlurmError(f"the engines' Slurm {launcher.failure}" + (f"\n{tail}" if tail else ""))
        state = getattr(launcher, "job", None)
        if state is not None and state.state == "RUNNING" and running_since is None:
            running_since = time.monotonic()
        if running_since is not None and time.monotonic() - running_since > timeout:
            tail = _output_tail(launcher)
            raise SlurmError(f"job {launcher.job_id} RUNNING for {timeout:.0f} s but only {len(client.ids)} of "
                             f"{n} engines registered" + (f"; its output:\n{tail}" if tail else ""))
        time.sleep(0.1)


def engine_launcher(environ: Mapping[str, str] | None = None) -> type:
    """The engine launcher class for the ``slurm`` profile: srun inside an allocation, sbatch outside."""
    return SrunEngineSetLauncher if in_allocation(environ) is not None else SlurmBatchEngineSetLauncher


def configure(config: Any, launcher: type, options: SlurmOptions, engine_cmd: list[str] | None = None,
              environment: Mapping[str, str] | None = None,
              progress: Callable[[str], None] | None = None) -> Any:
    """Write ``options`` (and the engine command, the engines' environment, the progress callback) into the
    traitlets ``config`` section of ``launcher``; returns ``config``.

    The section is the class's own, so it takes precedence over what a ``MPIEngineSetLauncher`` section (the
    local profile's) says about ``mpi_cmd`` or ``environment``.
    """
    section = config[launcher.__name__]
    if engine_cmd is not None:
        section.engine_cmd = list(engine_cmd)
    if environment is not None:
        section.environment = dict(environment)
    if launcher.__name__ == "SrunEngineSetLauncher":  # or a subclass named alike: srun options, no sbatch
        extra = ["--overlap"] if os.environ.get("SLURM_STEP_ID") not in (None, "", "batch") else []
        nodes = [f"--nodes={options.nodes}"] if options.nodes else []
        gres = [f"--gres=gpu:{options.gpus_per_node}"] if options.gpus_per_node else []
        section.mpi_args = [*SRUN_ARGS, *extra, *nodes, *gres]
        return config
    if options.partition:
        section.queue = options.partition
    if options.time:
        section.timelimit = options.time
    section.directives = options.directives()
    if options.queue_timeout is not None:
        section.queue_timeout = float(options.queue_timeout)
    if progress is not None:
        section.progress = progress
    return config


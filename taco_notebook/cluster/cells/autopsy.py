"""The hang autopsy, read from outside the ranks: every rank's stacks and collective, grouped, suspects named.

Each rank serves its state on a Unix socket (:mod:`taco_notebook.comm.diagnostics.listener`, a listener thread
started at engine setup), so the autopsy needs neither the ranks' main threads nor the notebook kernel's: the
kernel's cell runner reads it when a rank raises a StallError (the ranks that waited report themselves as they
were when their watchdog fired), ``%taco_cluster stacks`` reads it on demand, and the Jupyter server reads it for
the sidebar while a cell holds the kernel (``GET /taco-notebook/api/clusters/{id}/stacks``). A Unix socket is
reached only on its own host: the ranks of this host are read here, those of every other host by one ssh to it
that runs :mod:`taco_notebook.remote.autopsy_reader` there (the way hydra reaches the hosts), and the answers
merge into one report. Every rank and host is asked at once, so all ranks take as long as the slowest (at most
``timeout``, plus :data:`REMOTE_SETUP_S` for another host's ssh). A rank that does not answer is described by its
host's OS: its ``/proc/PID/status`` state and its main thread's ``wchan``; a host that ssh cannot reach, by ssh.

    >>> print(collect(cluster.ranks).text())  # doctest: +SKIP
    stacks of 4 ranks, read in 0.05 s
    ranks 0-2: allreduce #5 'step' (waited 3.0 s) in cell:6
    rank 3: cell:5 in <module>, no collective
    suspect: rank 3 (in no collective while ranks 0-2 wait in allreduce #5 'step')
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...comm.diagnostics.listener import socket_dir
from ...comm.diagnostics.userframes import library_file
from ...remote.autopsy_reader import MODULE as HOST_READER
from ...remote.autopsy_reader import read_pids
from ..launch.hostfiles import ProfileError
from ..launch.overlay import overlay_for
from ..launch.sshcheck import runs_locally, ssh_command

__all__ = ["TIMEOUT_S", "REMOTE_SETUP_S", "RankAddress", "RankStacks", "Autopsy", "collect", "ask_ranks", "after_stall",
           "launcher_of", "read_remote", "host_answers", "rank_span"]

AFTER_STALL_TIMEOUT_S = 5.0  # the cell has failed already: a loaded rank gets longer to answer than on demand
_LIBRARY_FRAMES = 3  # shown of a thread that runs no user code: enough to see what it waits on
TIMEOUT_S = 1.5  # every rank is asked at once: the whole autopsy takes at most this, well within 2 s
REMOTE_SETUP_S = 1.5  # another host's ssh connection and Python start, on top of its ranks' TIMEOUT_S
_CELL_FILE = re.compile(r"(^<ipython-input-\d+-[0-9a-f]+>$)|(/ipykernel_\d+/\d+\.py$)|(^<string>$)")


@dataclass(frozen=True)
class RankAddress:
    """Where a rank is: what :func:`collect` needs of it (a cluster's RankInfo has these fields too)."""

    rank: int
    pid: int
    host: str


@dataclass
class RankStacks:
    """One rank's answer (``snapshot``, from :func:`taco_notebook.comm.diagnostics.listener.snapshot`) or why
    there is none (``missing``: what the OS says of the process)."""

    rank: int
    pid: int
    host: str
    snapshot: dict[str, Any] | None = None
    missing: str | None = None
    at_stall: bool = False  # the snapshot is the one the rank's watchdog took as it fired

    @property
    def collective(self) -> dict[str, Any] | None:
        return None if self.snapshot is None else self.snapshot.get("collective")

    def summary(self) -> str:
        """``allreduce #5 'step' in cell:6`` or ``cell:5 in <module>, no collective`` (without the wait)."""
        if self.snapshot is None:
            return f"no answer: {self.missing}"
        place = self.snapshot.get("place")
        where = f"{_short(place[0])}:{place[1]} in {place[2]}" if place else "idle (no user code running)"
        collective = self.collective
        if collective is None:
            return f"{where}, no collective"
        return f"{_title(collective)} at {where}"


@dataclass
class Autopsy:
    """Every rank's :class:`RankStacks`, how long reading them took, and the ranks it suspects."""

    ranks: list[RankStacks]
    seconds: float
    suspects: list[int] = field(default_factory=list)
    why: str = ""

    def text(self, stacks: bool = True, full: bool = False) -> str:
        """The report: one line per group of ranks in the same place, the suspects, then (``stacks``) the thread
        stacks that matter, each with the ranks that share it: threads running user code (the suspects' first),
        then those inside a collective, then every other thread (the kernel's, zmq's, taco's idle ones) folded
        into one line where it waits. ``full``: every thread with every frame instead."""
        lines = [f"stacks of {len(self.ranks)} rank{'s' if len(self.ranks) != 1 else ''}, read in "
                 f"{self.seconds:.2f} s" + (" (ranks marked * as their stall watchdog fired)"
                                            if any(r.at_stall for r in self.ranks) else "")]
        for summary, group in _grouped(self.ranks, lambda r: r.summary()):
            waits = [r.collective["waited_s"] for r in group if r.collective is not None]
            wait = f" (waited {max(waits):.1f} s)" if waits else ""
            star = "*" if all(r.at_stall for r in group) else ""
            if wait and " at " in summary:
                head, _, tail = summary.partition(" at ")
                summary = f"{head}{wait} at {tail}"
            lines.append(f"{rank_span([r.rank for r in group])}{star}: {summary}")
        lines.append(f"suspect: {rank_span(self.suspects)} ({self.why})" if self.suspects else
                     f"no suspect: {self.why}")
        if stacks:
            lines.extend(self._stacks(full))
        return "\n".join(lines)

    def _stacks(self, full: bool) -> list[str]:
        threads: list[tuple[int, str, str, tuple[tuple[Any, ...], ...]]] = []  # rank, kind, name, frames
        for rank in sorted(self.ranks, key=lambda r: (r.rank not in self.suspects, r.rank)):
            for thread in (rank.snapshot or {}).get("threads", []):
                raw = thread["frames"] if full else _shown(thread["frames"])
                frames = tuple((_short(f[0]), f[1], f[2], f[3]) for f in raw)
                threads.append((rank.rank, "all" if full else _kind(thread["frames"]), thread["name"], frames))
        threads.sort(key=lambda t: _KINDS.index(t[1]) if t[1] in _KINDS else 0)  # stable: suspects first within
        lines = []
        for (kind, name, frames), group in _grouped(threads, lambda t: t[1:]):
            if kind == "idle":
                continue
            lines.append(f"--- {rank_span([t[0] for t in group])}, thread {name}:")
            lines.extend(f"    {f[0]}:{f[1]} in {f[2]}" + (f": {f[3]}" if f[3] else "") for f in frames)
        idle = [t for t in threads if t[1] == "idle"]
        if idle:
            lines.append("--- other threads, one line each: where it waits")
        for (name, where), group in _grouped(idle, lambda t: (t[2], t[3][-1][:3] if t[3] else ())):
            place = f"{where[0]}:{where[1]} in {where[2]}" if where else "no frames"
            lines.append(f"    {rank_span([t[0] for t in group])}, thread {name}: {place}")
        return lines

    def to_dict(self, full: bool = False) -> dict[str, Any]:
        """The report as JSON for the REST API: ``text`` (``full``: every frame), ``suspects``, ``seconds`` and
        each rank's answer."""
        return {"text": self.text(full=full), "suspects": self.suspects, "why": self.why, "seconds": self.seconds,
                "ranks": [{"rank": r.rank, "pid": r.pid, "host": r.host, "summary": r.summary(),
                           "collective": r.collective, "missing": r.missing, "at_stall": r.at_stall,
                           "threads": (r.snapshot or {}).get("threads", [])} for r in self.ranks]}

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text())

    def __str__(self) -> str:
        return self.text()


def collect(ranks: Iterable[Any], timeout: float = TIMEOUT_S, since: float | None = None,
            launcher_exec: str | None = None) -> Autopsy:
    """Ask every rank (objects with ``rank``, ``pid`` and ``host``: a cluster's RankInfo) at once. With
    ``since`` (a ``time.time()``), a rank whose stall watchdog fired after it reports itself as it was then.

    Ranks of this host are read here; those of each other host by one ssh to it (``launcher_exec``: the
    program that stands in for ssh, as a cluster's profile names it; None: the one emulated hosts publish, else
    ``ssh``) running :mod:`taco_notebook.remote.autopsy_reader` there. Every host is asked at once."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    began = time.monotonic()
    answers = ask_ranks(ranks, timeout, launcher_exec)
    found = [_rank_stacks(info, answers.get(info.rank), since) for info in ranks]
    autopsy = Autopsy(found, time.monotonic() - began)
    autopsy.suspects, autopsy.why = _suspects(found)
    return autopsy


def ask_ranks(ranks: Sequence[Any], timeout: float, launcher_exec: str | None = None,
              request: dict[str, Any] | None = None) -> dict[int, dict[str, Any]]:
    """Every rank's listener's ``{"reply": …}`` to ``request`` (the stacks by default), else ``{"missing": why}``,
    by rank: this host's here, each other host's through one ssh (see :func:`collect`), all at once."""
    directory = socket_dir()
    by_host: dict[str, list[int]] = {}
    for info in ranks:
        by_host.setdefault(info.host, []).append(info.pid)
    remote = [host for host in by_host if not runs_locally(host)]
    ssh, ssh_error = _ssh_program(remote, launcher_exec)
    with ThreadPoolExecutor(max(1, min(64, len(by_host))), thread_name_prefix="taco-autopsy-host") as pool:
        asked = {host: pool.submit(read_pids, pids, directory, timeout, request) if host not in remote else
                 pool.submit(read_remote, host, pids, ssh, directory, timeout, ssh_error, request)
                 for host, pids in by_host.items()}
        answers = {host: future.result() for host, future in asked.items()}
    return {info.rank: answers[info.host].get(info.pid) or {"missing": "not asked"} for info in ranks}


def after_stall(cluster: Any, targets: Sequence[int], sink: Any, since: float) -> None:
    """The cell runner's autopsy when a rank raised a StallError (while its peers still run): the ranks that
    gave up as their watchdog saw them (if it fired after ``since``, a ``time.time()``), the others as they are
    now, shown as a warning under the cell. Not on an elastic cluster: there a stalled rank is a lost member,
    ended at once (:mod:`taco_notebook.cluster.elastic.recovery`), and the run must not wait for its stacks."""
    if cluster.elastic is not None:
        return
    chosen = [r for r in cluster.ranks if r.rank in targets]
    try:
        report = collect(chosen, timeout=AFTER_STALL_TIMEOUT_S, since=since, launcher_exec=launcher_of(cluster))
    except Exception as exc:  # noqa: BLE001 - the cell's own failure is what must reach the user
        sink.warn(f"hang autopsy failed: {type(exc).__name__}: {exc}")
        return
    sink.warn(f"hang autopsy: {report.text()}")


def launcher_of(cluster: Any) -> str | None:
    """The program a cluster's profile reaches its hosts with (hydra's ``-launcher-exec``), None for ``ssh``."""
    profile = getattr(cluster, "profile", None)
    return getattr(profile, "launcher_exec", None)


def _ssh_program(hosts: Sequence[str], launcher_exec: str | None) -> tuple[str, str | None]:
    """What reaches ``hosts``: ``launcher_exec``, else the emulated hosts' published stand-in, else ``ssh``; and
    why none can be used (an unsafe launch overlay), or None."""
    if launcher_exec is not None or not hosts:
        return launcher_exec or "ssh", None
    try:
        overlay = overlay_for(hosts)
    except ProfileError as exc:
        return "ssh", str(exc)
    return (overlay.launcher_exec if overlay is not None else "ssh"), None


def read_remote(host: str, pids: Sequence[int], ssh: str, directory: Path, timeout: float,
                refused: str | None = None, request: dict[str, Any] | None = None) -> dict[int, dict[str, Any]]:
    """The answers of ``pids`` on ``host``: :mod:`taco_notebook.remote.autopsy_reader` run there through one
    ``ssh`` (this interpreter's path, as the engines are started), given ``timeout`` per rank plus
    :data:`REMOTE_SETUP_S` for ssh and Python to start; past that the ssh is killed and every pid is missing, with
    the reason."""
    if refused is not None:
        return _all_missing(pids, f"host {host}: not asked over ssh: {refused}")
    remote = [sys.executable, "-m", HOST_READER, "--dir", str(directory), "--timeout", f"{timeout:g}",
              *(["--request", json.dumps(request)] if request is not None else []), *map(str, pids)]
    budget = timeout + REMOTE_SETUP_S
    # ssh joins the words for the host's shell; its own connect timeout outlasts ours, so the kill below bounds it
    argv = ssh_command(ssh, host, [shlex.quote(word) for word in remote], budget + 1)
    try:
        run = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    except OSError as exc:
        return _all_missing(pids, f"host {host}: ssh failed: {ssh} cannot be run ({exc.strerror or exc})")
    try:
        out, err = run.communicate(timeout=budget)
    except subprocess.TimeoutExpired:
        run.kill()  # our own child, by its pid; the reader on the host ends by itself within its timeout
        run.communicate()
        return _all_missing(pids, f"host {host}: no answer over ssh in {budget:g} s (ssh stopped)")
    return host_answers(host, pids, run.returncode, out, err)


def host_answers(host: str, pids: Sequence[int], returncode: int, stdout: str,
                 stderr: str) -> dict[int, dict[str, Any]]:
    """The answers in a host reader's output (its last stdout line: ``{"host", "pids"}``), or each pid missing
    with why: ssh's last line of stderr when it failed, the output when it is not the reader's JSON."""
    if returncode != 0:
        said = [line for line in stderr.strip().splitlines() if line.strip()]
        return _all_missing(pids, f"host {host}: ssh failed: {said[-1] if said else f'exit status {returncode}'}")
    lines = stdout.strip().splitlines()
    try:
        answers = json.loads(lines[-1]).get("pids") if lines else None
    except (ValueError, AttributeError):
        answers = None
    if not isinstance(answers, dict):
        shown = lines[-1][:200] if lines else ""
        return _all_missing(pids, f"host {host}: its stacks reader printed no report (got {shown!r})")
    return {pid: answers.get(str(pid)) or {"missing": f"host {host}: its stacks reader did not report process {pid}"}
            for pid in pids}


def _all_missing(pids: Sequence[int], why: str) -> dict[int, dict[str, Any]]:
    return {pid: {"missing": why} for pid in pids}


def _rank_stacks(info: Any, answer: dict[str, Any] | None, since: float | None) -> RankStacks:
    stacks = RankStacks(info.rank, info.pid, info.host)
    reply = (answer or {}).get("reply")
    if not isinstance(reply, dict):
        stacks.missing = str((answer or {}).get("missing") or f"no answer for process {info.pid}")
        return stacks
    stall = reply.get("at_stall")
    if since is not None and stall is not None and stall.get("taken_at", 0) >= since:
        stacks.snapshot, stacks.at_stall = stall, True
    else:
        stacks.snapshot = reply.get("now")
    return stacks


def _suspects(ranks: Sequence[RankStacks]) -> tuple[list[int], str]:
    """The ranks that are not where the others wait: in no collective, or another one, or silent."""
    silent = [r.rank for r in ranks if r.snapshot is None]
    waiting = [r for r in ranks if r.collective is not None]
    if not waiting:
        if silent:
            return silent, f"{rank_span(silent)} did not answer; no rank is in a collective"
        return [], "no rank is in a collective"
    places = _grouped(waiting, lambda r: (r.collective["seq"], r.collective["name"]))
    (seq, name), crowd = max(places, key=lambda p: (len(p[1]), p[0][0]))
    title = _title({"seq": seq, "name": name})
    crowd_ranks = {r.rank for r in crowd}
    elsewhere = [r for r in ranks if r.rank not in crowd_ranks and r.snapshot is not None]
    if not elsewhere and not silent:
        return [], f"every rank is in {title}: the network or the backend is stuck, not a rank"
    reasons = []
    idle = [r.rank for r in elsewhere if r.collective is None]
    other = [r.rank for r in elsewhere if r.collective is not None]
    who = f"{rank_span(sorted(crowd_ranks))} wait{'s' if len(crowd_ranks) == 1 else ''} in {title}"
    if idle:
        reasons.append(f"in no collective while {who}")
    if other:
        reasons.append(f"{rank_span(other)} in another collective while {who}")
    if silent:
        reasons.append(f"{rank_span(silent)} did not answer")
    return sorted(idle + other + silent), "; ".join(reasons)


_KINDS = ("user", "collective", "idle")
_WAIT_LOOPS = ((os.path.join("taco_notebook", "comm", "transport", "shm.py"), "_wait"),)  # file, function
_RUNNER = os.path.join("taco_notebook", "engine", "runner.py")  # runs a cell's code: the user's frames follow
_COLLECTIVE_FILES = (f"{os.sep}taco_notebook{os.sep}comm{os.sep}collectives{os.sep}",
                     f"{os.sep}taco_notebook{os.sep}comm{os.sep}transport{os.sep}",
                     f"{os.sep}torch{os.sep}distributed{os.sep}")


def _kind(frames: list[list[Any]]) -> str:
    """``user``: the thread runs user code (a frame outside the libraries); ``collective``: it is inside one of
    taco's collectives or torch.distributed (a communication thread at work); ``idle``: anything else (the
    kernel's and zmq's threads, taco's waiting for work)."""
    if any(not library_file(f[0]) for f in frames):
        return "user"
    if any(part in f[0] for f in frames for part in _COLLECTIVE_FILES):
        return "collective"
    return "idle"


def _shown(frames: list[list[Any]]) -> list[list[Any]]:
    """A thread's frames from the outermost frame of user code below taco's cell runner on (the engine's
    machinery above it is the same on every rank, ipyparallel's ``<string>`` shim that calls the runner
    included); a thread with no user code: its innermost frames, where it waits. A wait loop's own frames are
    cut: where in its poll a rank happens to be differs from rank to rank, its caller's line is the place."""
    loop = next((i for i, frame in enumerate(frames) if _in_wait_loop(frame)), None)
    frames = frames[:loop] if loop else frames
    runner = max((i for i, frame in enumerate(frames) if frame[0].endswith(_RUNNER)), default=-1)
    frames = frames[runner + 1:]
    first = next((i for i, frame in enumerate(frames) if not library_file(frame[0])), None)
    return frames[first:] if first is not None else frames[-_LIBRARY_FRAMES:]


def _in_wait_loop(frame: list[Any]) -> bool:
    return any(frame[0].endswith(path) and frame[2] == function for path, function in _WAIT_LOOPS)


def _title(collective: dict[str, Any]) -> str:
    kind, _, name = str(collective["name"]).partition(" ")
    return f"{kind} #{collective['seq']}" + (f" {name}" if name else "")


def _short(filename: str) -> str:
    """``cell`` for a notebook cell, a script's base name, a library file from its package on."""
    if _CELL_FILE.search(filename):
        return "cell"
    if library_file(filename):
        parts = Path(filename).parts
        for anchor in ("site-packages", "dist-packages"):
            if anchor in parts:
                return "/".join(parts[parts.index(anchor) + 1:])
        if "taco_notebook" in parts:
            return "/".join(parts[parts.index("taco_notebook"):])
        return "/".join(parts[-2:])
    return os.path.basename(filename) or filename


def _grouped(items: Iterable[Any], key: Any) -> list[tuple[Any, list[Any]]]:
    groups: dict[Any, list[Any]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.items())


def rank_span(ranks: Sequence[int]) -> str:
    """``rank 7``, ``ranks 0-6, 8-15``: consecutive ranks as ranges."""
    ordered = sorted(set(ranks))
    runs: list[list[int]] = []
    for rank in ordered:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)
    return f"rank{'s' if len(ordered) != 1 else ''} {text}"

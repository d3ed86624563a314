"""Emulated nodes as a user tool: ``taco-notebook emulate up 2x2 --link 1gbit``, ``status``, ``down``.

``up NODESxSLOTS`` makes NODES network-namespace nodes ``n0``, ``n1``, … on one bridge, each link shaped to
``--link`` (a ``tc`` rate such as ``1gbit``, or ``none``) in both directions, each node running a real ``sshd``
on its own private address with generated keys, so that ``ssh -F STATE/ssh/config n0 hostname`` answers ``n0``
and mpich's hydra (``-launcher ssh``) or a ``--profile hosts --hosts n0:2,n1:2`` cluster can use them as hosts.
It prints that hosts string, the ssh config and the mpiexec arguments. ``status`` lists the nodes and whether
their sshd still runs; ``down`` removes everything ``up`` made. Needs root (namespaces), iproute2 and OpenSSH.
``up --down-with PID`` also leaves a watcher (``down --when-gone PID``, in its own session) that takes the nodes
down once process PID ends, however it ends: a notebook's kernel killed by its client still leaves nothing behind.

Exit codes: 0 done / all healthy; 1 refused or failed (already up, a node dead); 2 bad input or this machine
cannot run it (not root, a tool missing; nothing is made); 3 ``status`` with nothing up.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from ..emulate.hosts import EmulatedHosts, EmulateError, check_prerequisites, default_state_dir, down
from ..emulate.nodes import parse_rate

__all__ = ["add_parser", "command", "parse_spec", "parse_link"]

NOTHING_UP = 3


def parse_spec(spec: str) -> tuple[int, int]:
    """``NODESxSLOTS`` → (nodes, slots per node): ``"2x2"`` → (2, 2).

    >>> parse_spec("3x4")
    (3, 4)
    """
    match = re.fullmatch(r"(\d+)x(\d+)", spec.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"the nodes must be NODESxSLOTS such as 2x2 (2 nodes of 2 slots), "
                                         f"got {spec!r}")
    nodes, slots = int(match[1]), int(match[2])
    if not 1 <= nodes <= 253:
        raise argparse.ArgumentTypeError(f"NODES in NODESxSLOTS must be 1..253, got {nodes} in {spec!r}")
    if not 1 <= slots <= 1024:
        raise argparse.ArgumentTypeError(f"SLOTS in NODESxSLOTS must be 1..1024, got {slots} in {spec!r}")
    return nodes, slots


def parse_link(link: str) -> str | None:
    """A ``tc`` rate (``1gbit``, ``100mbit``, ``125mbps``), or ``none`` for unshaped links."""
    if link.strip().lower() in ("none", "unlimited"):
        return None
    try:
        parse_rate(link)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{err}, or 'none' for unshaped links") from None
    return link.strip().lower()


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """``emulate up NODESxSLOTS | status | down``."""
    parser = subparsers.add_parser("emulate", help="emulated nodes on this machine (network namespaces, each with "
                                   "sshd): up, status, down", description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state-dir", type=Path, default=None,
                        help=f"where the nodes' state and keys live (default: {default_state_dir()}; "
                             "TACO_EMULATE_DIR sets it too)")
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", parents=[common], help="create the nodes and start their sshd")
    up.add_argument("spec", type=parse_spec, metavar="NODESxSLOTS", help="e.g. 2x2: 2 nodes of 2 slots")
    up.add_argument("--link", type=parse_link, default="1gbit",
                    help="each node's link rate, both ways: 1gbit (default), 100mbit, 125mbps, none")
    up.add_argument("--interface", default="taco0", help="the nodes' interface name (default taco0)")
    up.add_argument("--down-with", dest="down_with", type=int, default=None, metavar="PID",
                    help="take the nodes down when process PID ends, even if it is killed (a notebook's kernel: "
                         "os.getpid()); `down` before then works as always")
    status = sub.add_parser("status", parents=[common], help="list the nodes; nonzero if one is dead")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    down_cmd = sub.add_parser("down", parents=[common], help="remove the nodes and every file up made")
    down_cmd.add_argument("--when-gone", dest="when_gone", type=int, default=None, metavar="PID",
                          help="first wait until process PID ends (returns at once if the nodes go down before)")
    parser.set_defaults(run_command=lambda args: command(args, parser))
    return parser


def _rate_text(bits: int | None) -> str:
    return "unshaped" if bits is None else f"{bits / 1e9:g} Gbit/s each way"


def _print_usage_hints(hosts: EmulatedHosts) -> None:
    config = shlex.quote(str(hosts.ssh_config))
    first = hosts.nodes.nodes[0]
    print(f"hosts:   {hosts.hosts_string}")
    print(f"ssh:     ssh -F {config} {first} hostname")
    genv = [word for key, value in hosts.mpiexec_env({}).items() for word in ("-genv", key, value)]
    print(f"mpiexec: mpiexec {shlex.join(hosts.mpiexec_args())} -n {hosts.slots * len(hosts.nodes.nodes)} "
          f"{shlex.join(genv)} python train.py")


def _spawn_down_watcher(pid: int, state_dir: Path) -> int:
    """Start ``down --when-gone PID`` in a session of its own (no terminal, no output), so that it outlives
    this command and whatever kills PID's process group; returns its pid."""
    argv = [sys.executable, "-m", "taco_notebook", "emulate", "down", "--state-dir", str(state_dir),
            "--when-gone", str(pid)]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True).pid


def _wait_until_gone(pid: int, state_dir: Path, poll_s: float = 0.5) -> bool:
    """Wait until process ``pid`` (the one running now, not a later one given its number) has ended or is a
    zombie; False when the state directory went first (someone ran ``down``: nothing is left to do)."""
    import psutil

    try:
        process = psutil.Process(pid)
        while process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
            if not state_dir.exists():
                return False
            time.sleep(poll_s)
    except psutil.NoSuchProcess:
        pass
    return True


def _up(args: argparse.Namespace) -> int:
    num_nodes, slots = args.spec
    if args.down_with is not None and (args.down_with <= 0 or not _pid_exists(args.down_with)):
        raise EmulateError(f"--down-with {args.down_with}: no such process; give the pid of a running process "
                           "(a notebook's kernel: os.getpid())", 2)
    hosts = EmulatedHosts.up(num_nodes, slots, args.link, args.state_dir, interface=args.interface)
    if args.down_with is not None:
        try:
            watcher = _spawn_down_watcher(args.down_with, hosts.state_dir)
        except OSError:
            hosts.remove()
            raise
    nodes = hosts.nodes
    print(f"{num_nodes} emulated nodes up, {slots} slots each, links {_rate_text(nodes.rate_bits_per_s)}, "
          f"subnet {nodes.subnet}, state in {hosts.state_dir}")
    for host in nodes.nodes:
        print(f"  {host}  {nodes.address_of(host):<15} sshd pid {hosts.sshd[host].pid}")
    if args.down_with is not None:
        print(f"they go down when process {args.down_with} ends (watcher pid {watcher})")
    _print_usage_hints(hosts)
    return 0


def _pid_exists(pid: int) -> bool:
    import psutil

    return bool(psutil.pid_exists(pid))


def _status(args: argparse.Namespace) -> int:
    state_dir = (args.state_dir or default_state_dir()).absolute()
    hosts = EmulatedHosts.load(state_dir)
    if hosts is None:
        print(f"no emulated nodes are up (no state in {state_dir})")
        return NOTHING_UP
    rows = hosts.status()
    healthy = all(row.healthy for row in rows)
    if args.json:
        print(json.dumps({"state_dir": str(state_dir), "hosts": hosts.hosts_string, "ssh_config": str(hosts.ssh_config),
                          "launcher": str(hosts.launcher), "rate_bits_per_s": hosts.nodes.rate_bits_per_s,
                          "healthy": healthy, "nodes": [row.__dict__ for row in rows]}, indent=1))
        return 0 if healthy else 1
    print(f"emulated nodes in {state_dir}: links {_rate_text(hosts.nodes.rate_bits_per_s)}, "
          f"subnet {hosts.nodes.subnet}")
    print(f"  {'node':<5} {'address':<15} {'namespace':<18} {'sshd pid':>8}  state")
    for row in rows:
        state = "running" if row.healthy else ("sshd dead" if row.namespace_exists else "namespace gone")
        print(f"  {row.host:<5} {row.address:<15} {row.namespace:<18} {row.sshd_pid or '-':>8}  {state}")
    _print_usage_hints(hosts)
    if not healthy:
        print("some nodes are dead: `taco-notebook emulate down` removes what is left, then `up` again",
              file=sys.stderr)
    return 0 if healthy else 1


def _down(args: argparse.Namespace) -> int:
    state_dir = (args.state_dir or default_state_dir()).absolute()
    if args.when_gone is not None and not _wait_until_gone(args.when_gone, state_dir):
        print(f"the nodes in {state_dir} went down before process {args.when_gone} ended: nothing to remove")
        return 0
    if not state_dir.exists():
        print(f"no emulated nodes are up (no state in {state_dir}): nothing to remove")
        return 0
    check_prerequisites()
    hosts = down(state_dir)
    what = f"{len(hosts.nodes.nodes)} emulated nodes" if hosts else "a half-made state directory"
    print(f"removed {what}: sshd, namespaces, links, shaping, keys and {state_dir}")
    return 0


def command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the parsed ``emulate`` command; returns the exit code (see the module docstring)."""
    try:
        return {"up": _up, "status": _status, "down": _down}[args.action](args)
    except EmulateError as err:
        print(f"{parser.prog} {args.action}: {err}", file=sys.stderr)
        return err.exit_code
    except (ValueError, RuntimeError, OSError) as err:
        print(f"{parser.prog} {args.action}: {err}", file=sys.stderr)
        return 1

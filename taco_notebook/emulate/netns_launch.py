"""An ``ssh`` stand-in that runs a command "on" an emulated node: inside that node's network namespace.

mpich's hydra launches one proxy per host with ``-launcher ssh -launcher-exec THIS``, calling it exactly as
it calls ssh: ``THIS -x HOST "/path/hydra_pmi_proxy" --control-port ADDR:PORT ...``. As sshd does, the
command words are joined with spaces and handed to ``/bin/sh -c`` (hydra quotes the proxy path for a shell).

The command runs under ``ip netns exec NAMESPACE unshare --uts`` after ``hostname HOST``, so the node has its
own network *and* its own hostname (namespaces alone share the hostname, which would merge all nodes into
one), with ``TACO_NODE_NAME=HOST`` (read by :mod:`taco_notebook.comm.group.topology`) and ``GLOO_SOCKET_IFNAME``
set to the node's interface. The host -> namespace map is the JSON file named by ``TACO_NETNS_MAP``, written
by :class:`taco_notebook.emulate.nodes.EmulatedNodes`::

    {"interface": "taco0", "hosts": {"n0": "taco-1a2b3-n0", "n1": "taco-1a2b3-n1"},
     "env": {"UCX_TLS": "self,tcp"}}

Stdlib only, no package imports: it also runs as a plain script (``python .../netns_launch.py HOST CMD...``).
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["MAP_ENV", "parse_ssh_args", "load_map", "build_command", "main"]

MAP_ENV = "TACO_NETNS_MAP"
# ssh options that take a value (from ssh(1)); every other option is a flag such as hydra's -x.
_SSH_OPTS_WITH_VALUE = set("BbcDEeFIiJLlmOoPpQRSWw")
# Sets the hostname in the new UTS namespace, then runs the command like sshd would.
_INNER_SCRIPT = 'hostname "$0" || exit 255; exec /bin/sh -c "$1"'


def parse_ssh_args(argv: list[str]) -> tuple[str, str]:
    """Split ssh-style ``[OPTIONS] HOST COMMAND...`` into the host and the command string.

    >>> parse_ssh_args(["-x", "n1", '"/bin/proxy"', "--proxy-id", "1"])
    ('n1', '"/bin/proxy" --proxy-id 1')
    """
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        opt = argv[i]
        # "-p 22" takes the next word; "-p22" or "-oX=Y" carry the value inline; "-xT" is a bundle of flags.
        if len(opt) == 2 and opt[1] in _SSH_OPTS_WITH_VALUE:
            i += 1
        i += 1
    if i < len(argv) and argv[i] == "--":
        i += 1
    if i >= len(argv):
        raise ValueError("no host given: usage: netns_launch [SSH-OPTIONS] HOST COMMAND...")
    host = argv[i].rsplit("@", 1)[-1]  # user@host -> host
    command = " ".join(argv[i + 1:])
    if not command:
        raise ValueError(f"no command given for host {host!r}: an interactive login is not supported")
    return host, command


def load_map(path: str | None = None) -> dict:
    """Read the host → namespace map (the file named by ``TACO_NETNS_MAP`` by default)."""
    path = path or os.environ.get(MAP_ENV)
    if not path:
        raise ValueError(f"{MAP_ENV} is not set: it must name the JSON map written by EmulatedNodes")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data.get("hosts"), dict) or not data.get("interface"):
        raise ValueError(f"{path} is not an emulated-nodes map: it needs 'hosts' and 'interface'")
    return data


def build_command(host: str, command: str, mapping: dict) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that run ``command`` on emulated ``host``."""
    hosts = mapping["hosts"]
    if host not in hosts:
        raise ValueError(f"unknown emulated host {host!r}: this cluster has {', '.join(sorted(hosts))}")
    argv = ["ip", "netns", "exec", hosts[host], "unshare", "--uts", "--",
            "/bin/sh", "-c", _INNER_SCRIPT, host, command]
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in mapping.get("env", {}).items()})
    env["TACO_NODE_NAME"] = host
    env["GLOO_SOCKET_IFNAME"] = mapping["interface"]
    env["HOSTNAME"] = host
    return argv, env


def main(argv: list[str] | None = None) -> int:
    """Replace this process with the command running on the emulated host; 255 on error, like ssh."""
    args = sys.argv[1:] if argv is None else argv
    try:
        host, command = parse_ssh_args(args)
        exec_argv, env = build_command(host, command, load_map())
    except (ValueError, OSError) as err:
        print(f"netns_launch: {err}", file=sys.stderr)
        return 255
    if os.environ.get("TACO_NETNS_LAUNCH_LOG"):  # debugging aid: what hydra passed us
        with open(os.environ["TACO_NETNS_LAUNCH_LOG"], "a", encoding="utf-8") as log:
            log.write(json.dumps(args) + "\n")
    try:
        os.execvpe(exec_argv[0], exec_argv, env)
    except OSError as err:
        print(f"netns_launch: cannot run {exec_argv[0]!r}: {err}", file=sys.stderr)
    return 255


if __name__ == "__main__":
    sys.exit(main())

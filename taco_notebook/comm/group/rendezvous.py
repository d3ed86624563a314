"""Where the ranks meet to build the torch process group, with as little listening on the network as possible.

torch.distributed's stores and gloo have no authentication: whoever can reach a store can read and write the
rendezvous keys, so the store decides who can join. Hence:

- **One host** (every rank sees the same boot id and network namespace): a ``FileStore`` in a directory rank 0
  creates private (``mkdtemp``: 0700, random name, under ``$XDG_RUNTIME_DIR`` when it is private, else the temp
  dir), named to the others over MPI and removed when the group is destroyed (:func:`Rendezvous.close`, called
  by ``shutdown()``, so ``reinit()`` gets a fresh one; one left by a rank 0 that was killed is swept by the
  next job's rank 0: :func:`sweep_stale`). No port is opened for it. gloo's own data sockets are
  pinned to loopback (``GLOO_SOCKET_IFNAME=lo``) unless the user set that variable.
- **Several hosts** (or ``TACO_MASTER_ADDR`` set): rank 0's ``TCPStore``, on an OS-picked port, bound to the
  address of the interface the job uses (``TACO_MASTER_ADDR``, else ``GLOO_SOCKET_IFNAME``'s address, else the
  address the hostname resolves to). torch's own TCPStore listens on every interface whatever host it is
  given; binding the socket here and handing torch its descriptor (``master_listen_fd``) keeps it on that one.

What listens, after this (tests/comm/test_rendezvous.py checks it):

- one host: each rank's gloo pairs on 127.0.0.1 (one ephemeral port per rank, while the group lives). MPI
  ranks: nothing, with ``UCX_TLS=self,sm`` (``TacoCluster`` sets it; so does :func:`keep_mpi_local` on
  ``import taco_notebook.comm`` before MPI starts, when hydra says every rank is local). Hydra's ``mpiexec``: one
  control port on 0.0.0.0 for the job's lifetime (its ranks inherit the descriptor), which no hydra option or
  variable moves (not ``-iface lo``, ``-launcher fork``, ``-localhost`` nor ``HYDRA_IFACE``);
  ``MPIEXEC_PORT_RANGE`` only chooses its port, for a firewall rule. The ipyparallel controller and engines
  listen on 127.0.0.1 only.
- several hosts: rank 0's store on its job interface address; gloo pairs on ``GLOO_SOCKET_IFNAME``'s address
  (else the hostname's); hydra's control port on 0.0.0.0 of the launching host and UCX's per-rank listeners on
  the job's network. None of them authenticates: firewall the job's network to the job's hosts.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

__all__ = ["Rendezvous", "create", "placement", "single_host", "private_base_dir", "job_address", "keep_mpi_local",
           "sweep_stale", "open_meeting", "join_meeting"]

_IFNAME = "GLOO_SOCKET_IFNAME"


@dataclass
class Rendezvous:
    """A process group's store and what was set up for it, undone by :meth:`close`."""

    store: Any = field(repr=False)
    kind: str  # "file" (one host) or "tcp" (several hosts)
    address: str  # the FileStore's path, or "host:port" of the TCPStore
    directory: str | None = None  # the private directory this rank created (rank 0, file kind), removed at close
    pinned_ifname: bool = False  # this rank set GLOO_SOCKET_IFNAME and unsets it at close

    def close(self, wait_s: float = 0.0) -> None:
        """Forget the store, remove the private directory (its creator only), undo the loopback pin.

        Not collective. torch's FileStore destructor checks that the file exists, then opens it (``O_CREAT``) to
        count itself out; the last rank's removes the file. If the directory goes between the check and the open,
        that open fails with ENOENT and torch retries it for the store's whole timeout (the collective timeout)
        while holding the GIL, then terminates the process: a peer released by :func:`.bootstrap.abort` can hang
        there. So the creator waits up to ``wait_s`` for the peers' destructors to have removed the file
        (``shutdown()``: every rank is closing at the same time); a directory left empty is removed at once.
        Otherwise (``abort()`` passes 0: its peers are failing) the store file is unlinked now, so that a peer's
        destructor from then on finds no file and returns, and the directory goes :data:`REAP_AFTER_S` later on a
        timer thread, once a destructor that had already seen the file has long made its own in that directory.
        """
        self.store = None
        if self.directory is not None and self.kind == "file" and wait_s > 0:
            deadline = time.monotonic() + wait_s
            while os.path.exists(self.address) and time.monotonic() < deadline:
                time.sleep(0.005)
        if self.directory is not None:
            if os.path.exists(self.address):  # a directory is made for a FileStore only: the address is its file
                _reap_later(self.directory, self.address)
            else:
                shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
        if self.pinned_ifname:
            os.environ.pop(_IFNAME, None)
            self.pinned_ifname = False


REAP_AFTER_S = 2.0  # a peer's FileStore destructor between its check of the file and its open: microseconds
_reaping: dict[str, Any] = {}  # directory -> the timer that removes it (removed at exit if still pending)


def _reap_later(directory: str, store_file: str) -> None:
    """Unlink ``store_file`` now and remove ``directory`` :data:`REAP_AFTER_S` later (see
    :meth:`Rendezvous.close`) on a daemon timer thread; at interpreter exit, at once. A process that ends without
    exiting (``MPI_Abort``, a signal) leaves it to the next job's :func:`sweep_stale`."""
    import threading

    with contextlib.suppress(OSError):  # the last peer removed it meanwhile
        os.unlink(store_file)
    timer = threading.Timer(REAP_AFTER_S, _reap, args=(directory,))
    timer.name, timer.daemon = "taco-rendezvous-reaper", True
    _reaping[directory] = timer
    timer.start()


def _reap(directory: str) -> None:
    _reaping.pop(directory, None)
    shutil.rmtree(directory, ignore_errors=True)


def _reap_all() -> None:
    for directory, timer in list(_reaping.items()):
        timer.cancel()
        _reap(directory)


atexit.register(_reap_all)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _net_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def placement() -> tuple[str, str, str]:
    """What tells hosts apart: the kernel's boot id (shared by namespaces on one machine, different across
    machines), the network namespace (emulated nodes each have their own) and the hostname."""
    return (_boot_id(), _net_namespace(), socket.gethostname())


def single_host(mpi: Any) -> bool:
    """True when every rank runs on this machine in this network namespace (collective over ``mpi``)."""
    return len(set(mpi.allgather(placement()))) == 1


def private_base_dir() -> str:
    """``$XDG_RUNTIME_DIR`` when it is a directory of ours that nobody else can enter, else the temp dir."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        try:
            info = os.lstat(runtime)
        except OSError:
            info = None
        if (info is not None and stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
                and not info.st_mode & 0o077):
            return runtime
    return tempfile.gettempdir()


def _loopback_interface() -> str:
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
            return name
    return "lo"


_PREFIX = "taco-rendezvous-"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid").strip("pid:[]")
    except OSError:
        return "0"


def _creator_gone(name: str) -> bool:
    """True when the directory ``name`` was made in this pid namespace by a process that no longer exists."""
    parts = name[len(_PREFIX):].split("-")
    if len(parts) < 3 or parts[0] != _pid_namespace() or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, someone else's: a reused pid keeps the directory, the safe side
        return False
    return False


def sweep_stale(base: str) -> list[str]:
    """Remove rendezvous directories of ours whose rank 0 died without ``shutdown()`` (killed, or its job
    aborted): only directories owned by this user, not symlinks, named for a gone process of this pid
    namespace. Returns what was removed."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(base, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and _creator_gone(name):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _new_store_file() -> tuple[str, str]:
    """(private directory, store file path) made by the group's rank 0; the error says where and what to do."""
    try:
        base = private_base_dir()
        sweep_stale(base)
        prefix = f"{_PREFIX}{_pid_namespace()}-{os.getpid()}-"
        directory = tempfile.mkdtemp(prefix=prefix, dir=base)  # 0700, O_EXCL, random suffix
        path = os.path.join(directory, "store")
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError as exc:
        raise RuntimeError(f"rank 0 could not create the rendezvous directory under {private_base_dir()!r}: "
                           f"{exc}; set TMPDIR to a writable private directory") from None
    return directory, path


def _open_file_store(path: str, size: int, timeout: timedelta, directory: str | None) -> Rendezvous:
    import torch.distributed as dist

    pinned = False
    if _IFNAME not in os.environ:
        os.environ[_IFNAME] = _loopback_interface()
        pinned = True
    store = dist.FileStore(path, size)
    store.set_timeout(timeout)
    return Rendezvous(store, "file", path, directory, pinned)


def _file_store(mpi: Any, timeout: timedelta) -> Rendezvous:
    directory = None
    if mpi.Get_rank() == 0:
        try:
            directory, path = _new_store_file()
            message: tuple[str, str] = ("ok", path)
        except RuntimeError as exc:
            message = ("error", str(exc))
    else:
        message = ("", "")
    status, text = mpi.bcast(message, root=0)
    if status != "ok":
        raise RuntimeError(text)
    return _open_file_store(text, mpi.Get_size(), timeout, directory)


def _interface_address(ifname: str) -> str:
    import psutil

    for addr in psutil.net_if_addrs().get(ifname, []):
        if addr.family == socket.AF_INET:
            return str(addr.address)
    raise RuntimeError(f"interface {ifname!r} ({_IFNAME}) has no IPv4 address")


def job_address() -> str:
    """The address rank 0's store binds and the others dial: the interface the job uses."""
    if os.environ.get("TACO_MASTER_ADDR"):
        return socket.gethostbyname(os.environ["TACO_MASTER_ADDR"])
    ifname = os.environ.get(_IFNAME, "").split(",")[0]
    if ifname:
        return _interface_address(ifname)
    return socket.gethostbyname(socket.gethostname())


def _bound_listener(address: str) -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((address, 0))
    except OSError as exc:
        listener.close()
        raise RuntimeError(f"rank 0 cannot listen on {address} ({exc}): set TACO_MASTER_ADDR or "
                           f"{_IFNAME} to an address of rank 0's host that the other hosts reach") from None
    listener.listen(socket.SOMAXCONN)
    return listener


def _tcp_master(size: int, timeout: timedelta) -> Any:
    """Rank 0's TCPStore on the job's interface (raises RuntimeError or OSError naming the address)."""
    import torch.distributed as dist

    listener = _bound_listener(job_address())
    host, port = listener.getsockname()[:2]
    # torch takes the descriptor over (and closes it): detach so Python does not close it twice
    return dist.TCPStore(host, port, size, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=listener.detach())


def _tcp_store(mpi: Any, timeout: timedelta) -> Rendezvous:
    import torch.distributed as dist

    store = None
    message: tuple[str, str, int] | None = None
    if mpi.Get_rank() == 0:
        try:
            store = _tcp_master(mpi.Get_size(), timeout)
            message = ("ok", store.host, store.port)
        except (OSError, RuntimeError) as exc:
            message = ("error", str(exc), 0)
    status, host, port = mpi.bcast(message, root=0)
    if status != "ok":
        raise RuntimeError(host)
    if store is None:
        store = dist.TCPStore(host, port, mpi.Get_size(), is_master=False, timeout=timeout)
    return Rendezvous(store, "tcp", f"{host}:{port}")


def open_meeting(kind: str, size: int, timeout_s: float) -> Rendezvous:
    """The store of a ``size``-rank group whose members were chosen without MPI (elastic), made by its rank 0.

    ``kind`` "file" (every member on this host and namespace) or "tcp"; the others join with
    :func:`join_meeting` and the returned :attr:`Rendezvous.address`.
    """
    timeout = timedelta(seconds=timeout_s)
    if kind == "file":
        directory, path = _new_store_file()
        return _open_file_store(path, size, timeout, directory)
    store = _tcp_master(size, timeout)
    return Rendezvous(store, "tcp", f"{store.host}:{store.port}")


def join_meeting(kind: str, address: str, size: int, timeout_s: float) -> Rendezvous:
    """The store :func:`open_meeting` made on the group's rank 0, seen from another member."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if kind == "file":
        return _open_file_store(address, size, timeout, None)
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), size, is_master=False, timeout=timeout)
    return Rendezvous(store, "tcp", address)


def create(mpi: Any, timeout_s: float) -> Rendezvous:
    """The store for a new process group over every rank of ``mpi`` (collective).

    A FileStore in a private directory when the job is on one host and ``TACO_MASTER_ADDR`` is not set, a
    TCPStore bound to the job's interface otherwise.
    """
    timeout = timedelta(seconds=timeout_s)
    one_host = single_host(mpi)
    if one_host and not os.environ.get("TACO_MASTER_ADDR"):
        return _file_store(mpi, timeout)
    return _tcp_store(mpi, timeout)


def keep_mpi_local() -> bool:
    """Before MPI starts, when hydra says every rank runs on this host, keep MPICH's UCX off the network.

    UCX would otherwise open a listener per rank on the LAN address; shared memory is what it uses between local
    ranks anyway. Hydra sets ``MPI_LOCALNRANKS`` (ranks on this host) and ``PMI_SIZE`` (all ranks) for each rank.
    Does nothing when the user set ``UCX_TLS``, when MPI is already initialised (mpi4py imported first) or under
    another launcher. Returns True when it set ``UCX_TLS``.
    """
    if "UCX_TLS" in os.environ or "mpi4py.MPI" in sys.modules:
        return False
    local, world = os.environ.get("MPI_LOCALNRANKS"), os.environ.get("PMI_SIZE")
    if local is None or local != world:
        return False
    os.environ["UCX_TLS"] = "self,sm"
    return True

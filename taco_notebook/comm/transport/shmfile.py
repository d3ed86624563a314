"""Where a node's shared segment lives, and how its file is made, named, opened and reclaimed: private to this
user, never through a symlink, never a file someone else planted under the expected name.

A hugetlbfs mount with free huge pages is preferred (what HARP-style stacks need anyway), else ``/dev/shm``
when it has room: a tmpfs maps past its size and then kills the writer with SIGBUS, and a container's
``/dev/shm`` is often 64 MiB.

A segment file has no name (``O_TMPFILE``) unless its ranks must open it by name. A name says whose it is:
``taco-<uid>-<boot id>-<pid namespace>-<pid>-<start>-<tag>``, the user and the process that made it (its pid and
start time on this boot, in this pid namespace). Its ranks remove it once all have mapped it
(:class:`.shm.NodeSegment`); one left by a maker that was killed first is removed by the next segment made on
the node (:func:`reclaim_orphans`), only where the name proves the file is this user's and its maker is dead.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
from collections.abc import Iterable

from .peers import started, stat_fields

__all__ = ["hugetlbfs_mount", "create", "open_own", "open_held", "segment_name", "reclaim_orphans"]

_NAME = re.compile(r"taco-(\d+)-([0-9a-f]{32})-(\d+)-(\d+)-(\d+)-.+")  # uid, boot id, pid namespace, pid, start


def hugetlbfs_mount() -> str | None:
    """A writable hugetlbfs mount with free huge pages, or None."""
    try:
        with open("/proc/mounts") as mounts:
            paths = [line.split()[1] for line in mounts if line.split()[2:3] == ["hugetlbfs"]]
        with open("/proc/meminfo") as meminfo:
            free = next((int(line.split()[1]) for line in meminfo if line.startswith("HugePages_Free:")), 0)
    except OSError:
        return None
    usable = [p for p in paths if os.access(p, os.W_OK)]
    return usable[0] if usable and free > 0 else None


def create(directory: str | None, name: str, total: int, named: bool) -> tuple[str, int]:
    """A new ``total``-byte segment: its path and a read-write fd on it, or ("", -1) when neither place has room
    for it. Unless ``named`` the file has no name at all (``O_TMPFILE``, or a name removed at once where the file
    system has no unnamed files): the path then only says where it lives."""
    for place in ([directory] if directory else []) + ["/dev/shm"]:
        path = os.path.join(place, name)
        try:
            if place == "/dev/shm":  # a tmpfs maps past its limit, then kills the writer with SIGBUS
                room = os.statvfs(place)
                if room.f_bavail * room.f_frsize < total:
                    continue
            fd = -1 if named else _unnamed(place)
            if fd < 0:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                if not named:
                    os.unlink(path)
        except OSError:
            continue
        try:
            os.ftruncate(fd, total)
            if place != "/dev/shm":  # hugetlbfs: check the pages really exist before using them
                mmap.mmap(fd, total).close()
            return path, fd
        except OSError:
            os.close(fd)
            if named:
                os.unlink(path)
    return "", -1


def _unnamed(place: str) -> int:
    """An fd on a new file in ``place`` that never has a name, or -1 where the file system makes none."""
    if not hasattr(os, "O_TMPFILE"):
        return -1
    try:
        return os.open(place, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError as error:
        if error.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return -1
        raise


def open_own(path: str) -> int:
    """Open the segment rank 0 named, refusing a symlink (``O_NOFOLLOW``) or a file another user owns: in a shared
    hugetlbfs mount or /dev/shm someone else could otherwise slip in a file of theirs under the expected name."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    owner = os.fstat(fd).st_uid
    if owner != os.geteuid():
        os.close(fd)
        raise PermissionError(f"shared segment {path} belongs to uid {owner}, not to this user: refusing to map it")
    return fd


def open_held(pid: int, fd: int, dev: int, ino: int) -> int:
    """Open the file that process ``pid`` holds open on ``fd``, whose name may be gone already, through
    ``/proc/<pid>/fd/<fd>``; refused unless it is the regular file ``(dev, ino)`` and this user's (a pid or fd
    number reused since is not taken for it)."""
    own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    found = os.fstat(own)
    if (found.st_dev, found.st_ino) != (dev, ino) or not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
        os.close(own)
        raise PermissionError(f"fd {fd} of pid {pid} is no longer the node's shared segment: refusing to map it")
    return own


def _identity() -> tuple[int, str, int] | None:
    """This process's user, boot id and pid namespace, or None when one is unknown or ``/proc`` shows another
    pid namespace than ours (its pids would not be the ones a name holds)."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return None
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip().replace("-", "")
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return (os.geteuid(), boot_id, namespace) if re.fullmatch(r"[0-9a-f]{32}", boot_id) else None


def segment_name(tag: str) -> str:
    """The file name of a segment this process makes: ``tag`` after its owner (user, boot, pid namespace,
    pid, start time), which :func:`reclaim_orphans` reads back. Without an identity the name proves nothing
    and is never reclaimed."""
    me, began = _identity(), started(os.getpid())
    if me is None or began <= 0:
        return f"taco-{tag}"
    uid, boot_id, namespace = me
    return f"taco-{uid}-{boot_id}-{namespace}-{os.getpid()}-{began}-{tag}"


def _ended(pid: int, began: int) -> bool:
    """Whether the process that started at ``began`` with ``pid`` is proven gone: no such pid, a later
    process under it, or a zombie. Anything unreadable is no proof."""
    try:
        fields = stat_fields(pid)
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return False
    try:
        return fields[0] == b"Z" or int(fields[19]) != began
    except (IndexError, ValueError):
        return False


def reclaim_orphans(directories: Iterable[str]) -> list[str]:
    """Remove the segments in ``directories`` that this user's processes made and that their makers, now dead,
    left behind; return their paths. Only names of this user, boot and pid namespace whose maker is proven
    gone are touched, and only regular files this user owns: never another user's, never a live job's."""
    me = _identity()
    if me is None:
        return []
    removed = []
    for directory in directories:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            found = _NAME.fullmatch(name)
            if found is None or (int(found[1]), found[2], int(found[3])) != me:
                continue
            if not _ended(int(found[4]), int(found[5])):
                continue
            path = os.path.join(directory, name)
            try:
                info = os.lstat(path)
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                    os.unlink(path)
                    removed.append(path)
            except OSError:  # gone already, or not ours to remove
                continue
    return removed

"""Where a node's shared segment lives, and how its file is made and opened: private to this user, never
through a symlink, never a file someone else planted under the expected name.

A hugetlbfs mount with free huge pages is preferred (what HARP-style stacks need anyway), else ``/dev/shm``
when it has room: a tmpfs maps past its size and then kills the writer with SIGBUS, and a container's
``/dev/shm`` is often 64 MiB.
"""

from __future__ import annotations

import mmap
import os

__all__ = ["hugetlbfs_mount", "create", "open_own"]


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


def create(directory: str | None, name: str, total: int) -> str:
    """The path of a new ``total``-byte segment, or "" when neither place has room for it."""
    for place in ([directory] if directory else []) + ["/dev/shm"]:
        path = os.path.join(place, name)
        try:
            if place == "/dev/shm":  # a tmpfs maps past its limit, then kills the writer with SIGBUS
                room = os.statvfs(place)
                if room.f_bavail * room.f_frsize < total:
                    continue
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.ftruncate(fd, total)
                if place != "/dev/shm":  # hugetlbfs: check the pages really exist before using them
                    mmap.mmap(fd, total).close()
            finally:
                os.close(fd)
            return path
        except OSError:
            if os.path.exists(path):
                os.unlink(path)
    return ""


def open_own(path: str) -> int:
    """Open the segment rank 0 named, refusing a symlink (``O_NOFOLLOW``) or a file another user owns: in a shared
    hugetlbfs mount or /dev/shm someone else could otherwise slip in a file of theirs under the expected name."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    owner = os.fstat(fd).st_uid
    if owner != os.geteuid():
        os.close(fd)
        raise PermissionError(f"shared segment {path} belongs to uid {owner}, not to this user: refusing to map it")
    return fd

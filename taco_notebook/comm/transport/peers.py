"""The processes of one node, seen from each other: futex sleeps and wakes on words in a shared mapping, and
whether a peer process is still alive.

:class:`.shm.NodeSegment` builds its waits on these: a rank sleeps on a futex word in the segment's header
until the last rank to arrive wakes it, and watches the pidfds of the peers it waits for, so a peer that died
ends the wait with an error naming it. Linux only (futex(2), pidfd_open(2)); elsewhere :data:`LIBC` is None
and the segment polls.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import sys
from typing import Any

__all__ = ["LIBC", "futex_wait", "futex_wake", "Pidfds", "stat_fields", "started", "watch"]

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): the word is in a mapping of several processes


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc() -> Any:
    if not sys.platform.startswith("linux") or _SYS_FUTEX is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # CDLL: the GIL is released for the call
        libc.syscall.restype = ctypes.c_long
        return libc
    except OSError:
        return None


LIBC = _libc()  # None where there is no futex: the callers poll


def futex_wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep until the 32-bit word at ``address`` is woken, unless it no longer holds ``expected`` (checked
    by the kernel atomically with going to sleep: a wake between our read and this call is not lost), or
    ``timeout_s`` passed. Every outcome (woken, changed, timed out, interrupted) just returns: the caller
    looks again."""
    spec = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_uint32(expected & 0xFFFFFFFF),
                 ctypes.byref(spec), None, 0)


def futex_wake(address: int) -> None:
    """Wake every process sleeping on the word at ``address``. Also a full memory barrier, even with no one
    to wake (the kernel's ``futex_hb_waiters_pending``)."""
    LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, 2**31 - 1, None, None, 0)


class Pidfds(dict[int, int]):
    """Local rank -> pidfd of that peer; the fds close when the last holder lets go (a wait on another thread
    may hold them past the segment's close)."""

    def __del__(self) -> None:
        for fd in self.values():
            with contextlib.suppress(OSError):
                os.close(fd)


def stat_fields(pid: int) -> list[bytes]:
    """Process ``pid``'s /proc/PID/stat after its name: ``[0]`` is field 3 (the state), ``[19]`` field 22 (its
    start). OSError where it cannot be read (FileNotFoundError: no such process)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return stat.read().rsplit(b")", 1)[1].split()


def started(pid: int) -> int:
    """When process ``pid`` started (clock ticks after boot, /proc/PID/stat field 22), or 0 if unknown: with
    the pid, it names one process, which a pid alone does not once the pid is reused."""
    try:
        return int(stat_fields(pid)[19])
    except (OSError, IndexError, ValueError):
        return 0


def watch(published: list[tuple[int, int]]) -> Pidfds:
    """A pidfd on each peer whose published ``(pid, start time)`` names a process visible here that started
    then; a peer in another pid namespace, or a pid reused since, is not watched (its waits end at the
    timeout). ``(0, 0)``: nothing to watch (this rank itself)."""
    fds = Pidfds()
    if not hasattr(os, "pidfd_open"):
        return fds
    for peer, (pid, began) in enumerate(published):
        if pid <= 0 or began <= 0:
            continue
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone already, or not visible from here
            continue
        if started(pid) == began:
            fds[peer] = fd
        else:
            os.close(fd)
    return fds

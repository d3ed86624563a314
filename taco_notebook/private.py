"""Files only their user can read: directories made 0700 and files 0600 at creation, trusted directories checked.

Everything taco_notebook writes (the registry, ipyparallel's profile and its logs, Jupyter's runtime dir when we
are the first to make it) can tell another user of a shared host what runs where, or, through a directory
another user can write, let them plant entries that our server would act on. So:

- :func:`make_private_dirs` creates each missing directory with ``os.mkdir(path, 0o700)`` (never chmod after:
  there is no window in which another user can open it);
- :func:`write_private_json` writes through ``tempfile.mkstemp`` (0600, ``O_EXCL``) and renames;
- :func:`check_private_dir` refuses a directory that is a symlink, not ours, or writable by group or others
  (``os.lstat``: a symlink is never followed), with a message that says how to fix it;
- :func:`read_private_json` opens with ``O_NOFOLLOW`` and reads a file only if its owner is the one expected and
  it is no larger than a limit, so a planted file cannot make a reader allocate or recurse without bound.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["UnsafeDirectoryError", "make_private_dirs", "check_private_dir", "write_private_json",
           "read_private_json", "tighten_own_dir", "private_ipython_profile", "DIR_MODE", "FILE_MODE"]

DIR_MODE = 0o700
FILE_MODE = 0o600


class UnsafeDirectoryError(PermissionError):
    """A directory taco_notebook would trust that another user could control; the message says how to fix it."""


def make_private_dirs(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` and its missing parents, each ``0700`` from the start; existing ones are left as they are.

    >>> make_private_dirs("/tmp/x/y")  # doctest: +SKIP
    """
    path = Path(path).absolute()
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:  # made meanwhile by another process: checked by whoever trusts it
            pass
    return path


def tighten_own_dir(path: str | os.PathLike[str]) -> None:
    """Create ``path`` 0700 if missing; if it exists, is ours and is open to others (made by an older version of
    this package under the umask), take group and others' access away. Someone else's directory is left alone."""
    make_private_dirs(path)
    info = os.lstat(path)
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and info.st_mode & 0o077:
        os.chmod(path, stat.S_IMODE(info.st_mode) & ~0o077, follow_symlinks=False)


def private_ipython_profile(profile: str | os.PathLike[str]) -> str:
    """The IPython profile directory ``profile`` (in the IPython dir) and its subdirs, made 0700 before IPython or
    ipyparallel would make them under the umask, the IPython dir itself too; returns the profile's path.

    The engines' log files (their output and tracebacks) are opened by ipyparallel itself, under the umask (often
    0644): the 0700 profile and log directories are what keeps other users from reaching them.
    """
    profile = os.path.abspath(profile)
    tighten_own_dir(os.path.dirname(profile))
    for directory in (profile, *(os.path.join(profile, sub) for sub in ("log", "security", "pid", "startup"))):
        tighten_own_dir(directory)
    return profile


def _describe(info: os.stat_result) -> str:
    try:
        import pwd

        owner = pwd.getpwuid(info.st_uid).pw_name
    except (ImportError, KeyError):
        owner = f"uid {info.st_uid}"
    return f"owner {owner}, mode {stat.filemode(info.st_mode)}"


def check_private_dir(path: str | os.PathLike[str], what: str = "directory",
                      fix: str | None = None) -> os.stat_result:
    """``path``'s ``lstat`` if it is a real directory of this user that no one else may write; else
    :class:`UnsafeDirectoryError` naming the directory, what is wrong and ``fix`` (default: the registry's)."""
    path = Path(path)
    info = os.lstat(path)
    me = os.geteuid()
    fix = fix or (f"remove it (rm -r {path}) so it is created again, private, or point TACO_REGISTRY_DIR "
                  "at a directory of your own with mode 0700")
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectoryError(f"refusing the {what} {path}: it is not a directory but "
                                   f"{'a symlink' if stat.S_ISLNK(info.st_mode) else 'a file'}; {fix}")
    if info.st_uid != me:
        raise UnsafeDirectoryError(f"refusing the {what} {path}: it belongs to another user ({_describe(info)}), "
                                   f"who could plant entries there; {fix}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectoryError(f"refusing the {what} {path}: group or others may write it ({_describe(info)}); "
                                   f"run chmod 700 {path}, or {fix}")
    return info


def write_private_json(path: Path, data: Any, what: str = "directory") -> None:
    """Write ``data`` as JSON to ``path`` (mode 0600) atomically, creating its directory 0700 when missing.

    The directory is checked first (:func:`check_private_dir`); readers never see half a file (``os.replace``).
    """
    make_private_dirs(path.parent)
    check_private_dir(path.parent, what)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # 0600, O_EXCL
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_private_json(path: Path, owner: int, max_bytes: int) -> Any:
    """The JSON in ``path`` if it is a regular file (not a symlink) owned by uid ``owner`` of at most ``max_bytes``.

    Raises FileNotFoundError when it is missing and ValueError (naming the file and the reason) otherwise.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ValueError(f"{path}: cannot open it ({exc.strerror}; a symlink is never followed)") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: not a regular file")
        if info.st_uid != owner:
            raise ValueError(f"{path}: owned by uid {info.st_uid}, not by uid {owner} who should own it")
        if info.st_size > max_bytes:
            raise ValueError(f"{path}: {info.st_size} bytes, over the limit of {max_bytes}")
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ValueError(f"{path}: over the limit of {max_bytes} bytes")
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None

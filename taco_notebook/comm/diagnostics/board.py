"""The progress board: which collective each rank of the group last entered, for the stall watchdog.

Every rank publishes, as its communication thread enters a collective, the collective's number in the group
and its label (``allreduce ('ddp-bucket', 3)``). Nobody reads the board until a collective has waited longer
than the stall timeout: then the waiting rank reads every rank's entry to name the ones that have not arrived,
and marks that it gave up, so that a late rank learns it as it enters the collective, instead of joining
peers that have left.

Two boards, by where the group's store is (:mod:`.rendezvous`):

- one host (FileStore): a small file in the rendezvous' private directory, mapped by every rank. Publishing is
  a write to shared memory, and so is the check for peers that gave up. Not the FileStore itself: it is an
  append-only log, so a key set per collective would grow it without end and each read would replay it.
- several hosts (TCPStore): one ``set`` per collective of the rank's key on rank 0's store (it waits for no
  reply). Checking for peers that gave up would cost a round trip per collective, so a late rank learns it
  only when its own collective stalls and it reads the board.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

__all__ = ["Entry", "Board", "SharedBoard", "StoreBoard", "open_board"]

_LABEL_BYTES = 48
_SLOT = struct.Struct(f"<qq{_LABEL_BYTES}s")  # seq entered, seq it gave up at (0: never), label
_HEADER = struct.Struct("<q56x")  # the first seq any rank gave up at (0: none)
_FILE = "progress"


@dataclass(frozen=True)
class Entry:
    """What one rank published: the number and label of the last collective it entered (0, '': none yet),
    and the number of the collective it gave up waiting in (0: none)."""

    rank: int
    seq: int
    label: str
    gave_up: int = 0


class Board:
    """The interface both boards share; ``seq`` counts this rank's collectives of the group."""

    seq = 0

    def publish(self, seq: int, label: str) -> None:
        raise NotImplementedError

    def abandoned(self) -> bool:
        """True when a peer gave up on the group (known cheaply on one host only; else False)."""
        return False

    def give_up(self, seq: int) -> None:
        raise NotImplementedError

    def read(self) -> list[Entry]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class SharedBoard(Board):
    """The board of a one-host group: a file of one 64-byte slot per rank, mapped by every rank."""

    def __init__(self, path: str, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        length = _HEADER.size + _SLOT.size * size
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # every rank may be first: all size it the same
        try:
            if os.fstat(fd).st_size < length:
                os.ftruncate(fd, length)
            self._map: mmap.mmap | None = mmap.mmap(fd, length)
        finally:
            os.close(fd)
        self._offset = _HEADER.size + _SLOT.size * rank

    def publish(self, seq: int, label: str) -> None:
        if self._map is not None:
            _SLOT.pack_into(self._map, self._offset, seq, 0, label.encode()[:_LABEL_BYTES])

    def abandoned(self) -> bool:
        return self._map is not None and _HEADER.unpack_from(self._map, 0)[0] != 0

    def give_up(self, seq: int) -> None:
        if self._map is None:
            return
        entered = _SLOT.unpack_from(self._map, self._offset)
        _SLOT.pack_into(self._map, self._offset, entered[0], seq, entered[2])
        if _HEADER.unpack_from(self._map, 0)[0] == 0:
            _HEADER.pack_into(self._map, 0, seq)

    def read(self) -> list[Entry]:
        if self._map is None:
            return []
        entries = []
        for rank in range(self.size):
            seq, gave_up, label = _SLOT.unpack_from(self._map, _HEADER.size + _SLOT.size * rank)
            entries.append(Entry(rank, seq, label.rstrip(b"\0").decode(errors="replace"), gave_up))
        return entries

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


class StoreBoard(Board):
    """The board of a group across hosts: a key per rank on the group's store (rank 0's TCPStore)."""

    def __init__(self, store: Any, rank: int, size: int) -> None:
        self.store: Any = store
        self.rank, self.size = rank, size
        self.publish(0, "")

    @staticmethod
    def _key(rank: int) -> str:
        return f"taco/progress/{rank}"

    def publish(self, seq: int, label: str) -> None:
        if self.store is not None:
            self.store.set(self._key(self.rank), f"{seq} {label}")

    def give_up(self, seq: int) -> None:
        if self.store is not None:
            self.store.set(f"taco/gave-up/{self.rank}", str(seq))

    def read(self) -> list[Entry]:
        if self.store is None:
            return []
        entries = []
        for rank in range(self.size):
            seq, label, gave_up = 0, "", 0
            if self.store.check([self._key(rank)]):
                seq_text, _, label = self.store.get(self._key(rank)).decode(errors="replace").partition(" ")
                seq = int(seq_text)
            if self.store.check([f"taco/gave-up/{rank}"]):
                gave_up = int(self.store.get(f"taco/gave-up/{rank}"))
            entries.append(Entry(rank, seq, label, gave_up))
        return entries

    def close(self) -> None:
        self.store = None


def open_board(rendezvous: Any, rank: int, size: int) -> Board:
    """The board of a group that met through ``rendezvous`` (:class:`.rendezvous.Rendezvous`), not collective:
    in its private directory on one host, on its store across hosts."""
    if rendezvous.kind == "file":
        return SharedBoard(os.path.join(os.path.dirname(rendezvous.address), _FILE), rank, size)
    return StoreBoard(rendezvous.store, rank, size)

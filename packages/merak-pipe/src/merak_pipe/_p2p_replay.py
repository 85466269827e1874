"""The replay engine behind the NCCL check and the issue-order fix-up (no process group).

Model ([Note: NCCL model]): each rank runs its p2p units one after another; within a unit every
operation runs at once and the unit finishes when all have; the k-th send from rank a to rank b
is matched with the k-th receive on b from a; a send and its receive complete together, each
while its unit runs. :class:`Replay` propagates completions until nothing moves; what is left
unfinished is a deadlock. :meth:`Replay.defer` moves a pending send into the next unit of its
rank (keeping the channel's order), which the issue-order fix-up uses to break a deadlock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Generic, Protocol, TypeVar


class _OpLike(Protocol):
    @property
    def send(self) -> bool: ...

    @property
    def peer(self) -> int: ...


OpT = TypeVar("OpT", bound=_OpLike)


class Replay(Generic[OpT]):
    """Mutable replay state over per-rank unit lists (lists of ops)."""

    def __init__(self, units: Mapping[int, Sequence[Sequence[OpT]]]) -> None:
        self.ranks = sorted(units)
        self.ops: list[OpT] = []
        self.rank_of: list[int] = []
        self.units: dict[int, list[list[int]]] = {}
        for rank in self.ranks:
            rank_units: list[list[int]] = []
            for unit in units[rank]:
                ids = []
                for op in unit:
                    ids.append(len(self.ops))
                    self.ops.append(op)
                    self.rank_of.append(rank)
                rank_units.append(ids)
            self.units[rank] = rank_units
        self.partner: list[int] = [-1] * len(self.ops)
        self.unmatched: list[int] = []
        self.channel_index: list[int] = [0] * len(self.ops)
        self._pair()
        self.done = bytearray(len(self.ops))
        self.unit_of: list[int] = [0] * len(self.ops)
        self.left: dict[int, list[int]] = {}
        for rank in self.ranks:
            counts = []
            for u, ids in enumerate(self.units[rank]):
                for i in ids:
                    self.unit_of[i] = u
                counts.append(len(ids))
            self.left[rank] = counts
        self.head = dict.fromkeys(self.ranks, 0)
        self._worklist = list(reversed(self.ranks))
        for rank in self.ranks:
            self._skip_empty(rank)

    def _pair(self) -> None:
        sends: dict[tuple[int, int], list[int]] = {}
        recvs: dict[tuple[int, int], list[int]] = {}
        for rank in self.ranks:
            for ids in self.units[rank]:
                for i in ids:
                    op = self.ops[i]
                    if op.send:
                        sends.setdefault((rank, op.peer), []).append(i)
                    else:
                        recvs.setdefault((op.peer, rank), []).append(i)
        for key in sorted(set(sends) | set(recvs)):
            s_list, r_list = sends.get(key, []), recvs.get(key, [])
            for k, (s, r) in enumerate(zip(s_list, r_list, strict=False)):
                self.partner[s], self.partner[r] = r, s
                self.channel_index[s] = self.channel_index[r] = k
            self.unmatched += s_list[len(r_list) :] + r_list[len(s_list) :]

    def _skip_empty(self, rank: int) -> None:
        left, n = self.left[rank], len(self.units[rank])
        while self.head[rank] < n and left[self.head[rank]] == 0:
            self.head[rank] += 1

    def is_running(self, i: int) -> bool:
        """True while op ``i``'s unit is the one its rank runs now."""
        return self.head[self.rank_of[i]] == self.unit_of[i]

    def run(self) -> None:
        """Complete every pair whose two units run, until nothing moves."""
        work = self._worklist
        while work:
            rank = work.pop()
            u = self.head[rank]
            if u >= len(self.units[rank]):
                continue
            for i in list(self.units[rank][u]):
                other = self.partner[i]
                if self.done[i] or other < 0 or not self.is_running(other):
                    continue
                self.done[i] = self.done[other] = 1
                self.left[rank][u] -= 1
                peer = self.rank_of[other]
                self.left[peer][self.unit_of[other]] -= 1
                if self.left[peer][self.unit_of[other]] == 0:
                    self._skip_empty(peer)
                    work.append(peer)
            if self.left[rank][u] == 0:
                self._skip_empty(rank)
                work.append(rank)

    def stuck(self) -> dict[int, int]:
        """Rank -> the unit it cannot finish (after :meth:`run`)."""
        return {r: self.head[r] for r in self.ranks if self.head[r] < len(self.units[r])}

    def waiting_sends(self, rank: int) -> list[int]:
        """Pending sends of ``rank``'s running unit whose partner's unit is not running."""
        u = self.head[rank]
        return [
            i
            for i in self.units[rank][u]
            if self.ops[i].send
            and not self.done[i]
            and self.partner[i] >= 0
            and not self.is_running(self.partner[i])
        ]

    def defer(self, i: int) -> bool:
        """Move pending send ``i`` (and the later sends of its channel in the same unit) to the next
        unit of its rank; False when there is no next unit."""
        rank, u = self.rank_of[i], self.unit_of[i]
        if u + 1 >= len(self.units[rank]):
            return False
        unit = self.units[rank][u]
        peer = self.ops[i].peer
        start = unit.index(i)
        moving = [
            j for j in unit[start:] if self.ops[j].send and self.ops[j].peer == peer and not self.done[j]
        ]
        for j in moving:
            unit.remove(j)
            self.unit_of[j] = u + 1
        self.units[rank][u + 1][:0] = moving
        self.left[rank][u] -= len(moving)
        self.left[rank][u + 1] += len(moving)
        if self.left[rank][u] == 0:
            self._skip_empty(rank)
        self._worklist.append(rank)
        return True

    def unit_ops(self, rank: int) -> list[list[OpT]]:
        """``rank``'s units as op lists, in their current form."""
        return [[self.ops[i] for i in ids] for ids in self.units[rank]]

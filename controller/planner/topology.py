"""Which GPU sets a model may run on: single cards, or several cards inside one NVLink board.

A board is a set of GPUs joined by NVLink (``profile.boards``, derived by the probe from
``nvidia-smi topo``). Cross-board traffic goes over PCIe and the CPU's NUMA links, which kills
throughput, so a multi-GPU service never spans boards. Inside a board the fattest links win: the
kit's dual-card bridge has 2 links per pair, the 12-GPU seed box has 6-link pairs and 2-link boards.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

from controller.profile import Gpu, HardwareProfile


@dataclass(frozen=True)
class GpuSet:
    """A candidate set of GPUs (physical indices), with what decides between equal fits."""

    gpus: tuple[int, ...]
    memory_mib: tuple[int, ...]
    board: tuple[int, ...]  # all V100s of the board this set lies in
    min_links: int  # NVLink links of the thinnest pair (0 when some pair is not directly linked)
    total_links: int

    @property
    def size(self) -> int:
        return len(self.gpus)

    @property
    def total_mib(self) -> int:
        return sum(self.memory_mib)

    def describe(self) -> str:
        if self.size == 1:
            return f"GPU {self.gpus[0]} ({self.memory_mib[0]} MiB)"
        links = f"NVLink x{self.min_links} per pair" if self.min_links else "NVLink (not every pair linked)"
        return f"GPUs {','.join(map(str, self.gpus))} ({'+'.join(map(str, self.memory_mib))} MiB, {links})"


class GpuPool:
    """The box's usable V100s, their boards and links, and which of them services already took."""

    def __init__(self, profile: HardwareProfile) -> None:
        self.gpus: dict[int, Gpu] = {gpu.index: gpu for gpu in profile.gpus if gpu.is_v100 and gpu.memory_mib}
        self.ignored: list[Gpu] = [gpu for gpu in profile.gpus if gpu.index not in self.gpus]
        self.links: dict[frozenset[int], int] = {frozenset((i, j)): n for i, j, n in profile.nvlink.pairs}
        self.boards: list[tuple[int, ...]] = self._boards(profile)
        self.taken: set[int] = set()
        names = {gpu.name for gpu in profile.gpus}
        self.mixed = len(names) > 1  # CUDA's default device order may then differ from nvidia-smi's

    def _boards(self, profile: HardwareProfile) -> list[tuple[int, ...]]:
        boards, seen = [], set()
        for board in profile.boards:
            members = tuple(sorted(i for i in board if i in self.gpus))
            if members:
                boards.append(members)
                seen.update(members)
        boards += [(i,) for i in sorted(self.gpus) if i not in seen]
        return boards

    @property
    def free(self) -> list[int]:
        return [i for i in sorted(self.gpus) if i not in self.taken]

    def board_of(self, index: int) -> tuple[int, ...]:
        return next(board for board in self.boards if index in board)

    def take(self, gpus: tuple[int, ...]) -> None:
        overlap = self.taken.intersection(gpus)
        if overlap:
            raise ValueError(f"GPUs {sorted(overlap)} are already given to another service")
        self.taken.update(gpus)

    def _set(self, gpus: tuple[int, ...], board: tuple[int, ...]) -> GpuSet:
        pairs = [self.links.get(frozenset(pair), 0) for pair in combinations(gpus, 2)]
        return GpuSet(gpus, tuple(self.gpus[i].memory_mib or 0 for i in gpus), board,
                      min(pairs, default=0), sum(pairs))

    def _connected(self, gpus: tuple[int, ...]) -> bool:
        reached, frontier = {gpus[0]}, [gpus[0]]
        while frontier:
            here = frontier.pop()
            for other in gpus:
                if other not in reached and self.links.get(frozenset((here, other)), 0) > 0:
                    reached.add(other)
                    frontier.append(other)
        return len(reached) == len(gpus)

    def candidates(self, size: int, powers_of_two: bool = False) -> list[GpuSet]:
        """Free GPU sets of ``size`` cards, each inside one board and joined by NVLink.

        Ordered for a tie: fattest links first, then the smallest board (a single card is taken
        from a pair before a four-card board is broken up), then the least memory (best fit).
        """
        if powers_of_two and size & (size - 1):
            return []
        out = []
        for board in self.boards:
            free = [i for i in board if i not in self.taken]
            for gpus in combinations(free, size):
                if size == 1 or self._connected(gpus):
                    out.append(self._set(gpus, board))
        return sorted(out, key=lambda s: (-s.min_links, -s.total_links, len(s.board), s.total_mib, s.gpus))

    def largest_free_board(self) -> GpuSet | None:
        """The free part of a board with the most memory (for expert offload), fewer cards on a tie."""
        sets = []
        for board in self.boards:
            free = tuple(i for i in board if i not in self.taken)
            if free and (len(free) == 1 or self._connected(free)):
                sets.append(self._set(free, board))
        return max(sets, key=lambda s: (s.total_mib, -s.size, -s.gpus[0]), default=None)

    @property
    def max_board(self) -> int:
        return max((len(board) for board in self.boards), default=0)

"""Which GPU sets a model may run on: single cards, or several cards inside one NVLink board.

A board is a set of GPUs joined by NVLink (``profile.boards``, derived by the probe from
``nvidia-smi topo``). Cross-board traffic goes over PCIe and the CPU's NUMA links, which kills
throughput, so a multi-GPU service never spans boards. Inside a board the fattest links win: the
kit's dual-card bridge has 2 links per pair, the 12-GPU seed box has 6-link pairs and 2-link boards.

The pool holds every card whose memory the probe saw, V100 or not; which of them a model may use is the
planner's ``usable`` test (an engine pack built for their architecture, one kind of card). Only a model
the fleet lets mix cards (``mix_cards``) may span boards: ``spanning`` sets, joined by PCIe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations, product

from controller.model.profile import Gpu, HardwareProfile

Usable = Callable[[tuple[int, ...]], bool]  # whether a model may run on these cards together


@dataclass(frozen=True)
class GpuSet:
    """A candidate set of GPUs (physical indices), with what decides between equal fits."""

    gpus: tuple[int, ...]
    memory_mib: tuple[int, ...]
    board: tuple[int, ...]  # all cards of the board this set lies in (a spanning set: itself)
    min_links: int  # NVLink links of the thinnest pair (0 when some pair is not directly linked)
    total_links: int
    spans: bool = False  # across boards (over PCIe): only for a model allowed to mix cards

    @property
    def size(self) -> int:
        return len(self.gpus)

    @property
    def total_mib(self) -> int:
        return sum(self.memory_mib)

    def describe(self) -> str:
        if self.size == 1:
            return f"GPU {self.gpus[0]} ({self.memory_mib[0]} MiB)"
        links = ("across boards, over PCIe" if self.spans else
                 f"NVLink x{self.min_links} per pair" if self.min_links else "NVLink (not every pair linked)")
        return f"GPUs {','.join(map(str, self.gpus))} ({'+'.join(map(str, self.memory_mib))} MiB, {links})"


class GpuPool:
    """The box's cards with a known memory, their boards and links, and which of them services already took."""

    def __init__(self, profile: HardwareProfile) -> None:
        self.gpus: dict[int, Gpu] = {gpu.index: gpu for gpu in profile.gpus if gpu.memory_mib}
        self.ignored: list[Gpu] = [gpu for gpu in profile.gpus if gpu.index not in self.gpus]
        self.links: dict[frozenset[int], int] = {frozenset((i, j)): n for i, j, n in profile.nvlink.pairs}
        self.boards: list[tuple[int, ...]] = self._boards(profile)
        self.taken: set[int] = set()
        self.owners: dict[int, str] = {}  # card -> the model it was given to
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

    def take(self, gpus: tuple[int, ...], owner: str = "") -> None:
        overlap = self.taken.intersection(gpus)
        if overlap:
            raise ValueError(f"GPUs {sorted(overlap)} are already given to another service")
        self.taken.update(gpus)
        self.owners.update(dict.fromkeys(gpus, owner))

    def _set(self, gpus: tuple[int, ...], board: tuple[int, ...]) -> GpuSet:
        pairs = [self.links.get(frozenset(pair), 0) for pair in combinations(gpus, 2)]
        return GpuSet(gpus, tuple(self.gpus[i].memory_mib or 0 for i in gpus), board,
                      min(pairs, default=0), sum(pairs))

    def _across(self, gpus: tuple[int, ...]) -> GpuSet:
        """Cards as one set that is no board of its own (joined by PCIe where no NVLink joins them)."""
        pairs = [self.links.get(frozenset(pair), 0) for pair in combinations(gpus, 2)]
        return GpuSet(gpus, tuple(self.gpus[i].memory_mib or 0 for i in gpus), gpus, min(pairs, default=0),
                      sum(pairs), spans=True)

    def _connected(self, gpus: tuple[int, ...]) -> bool:
        reached, frontier = {gpus[0]}, [gpus[0]]
        while frontier:
            here = frontier.pop()
            for other in gpus:
                if other not in reached and self.links.get(frozenset((here, other)), 0) > 0:
                    reached.add(other)
                    frontier.append(other)
        return len(reached) == len(gpus)

    def candidates(self, size: int, powers_of_two: bool = False, usable: Usable | None = None) -> list[GpuSet]:
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
                if (size == 1 or self._connected(gpus)) and (usable is None or usable(gpus)):
                    out.append(self._set(gpus, board))
        return sorted(out, key=lambda s: (-s.min_links, -s.total_links, len(s.board), s.total_mib, s.gpus))

    def spanning(self, size: int, usable: Usable) -> list[GpuSet]:
        """Free sets of ``size`` cards that ``usable`` accepts, across boards: one per mix of card kinds.

        Cards of one kind (architecture and memory) are interchangeable for a fit, so each mix is tried
        once, with the cards that keep boards together. Fewest kinds first, then the least memory.
        """
        groups: dict[tuple[int | None, int], list[int]] = {}
        order = {index: number for number, board in enumerate(self.boards) for index in board}
        for index in sorted(self.free, key=lambda i: (order[i], i)):
            gpu = self.gpus[index]
            groups.setdefault((gpu.arch, gpu.memory_mib or 0), []).append(index)
        kinds = sorted(groups)
        out = []
        for counts in product(*(range(len(groups[kind]) + 1) for kind in kinds)):
            if sum(counts) != size:
                continue
            gpus = tuple(sorted(i for kind, n in zip(kinds, counts) for i in groups[kind][:n]))
            if any(set(gpus) <= set(board) for board in self.boards) and self._connected(gpus):
                continue  # inside one NVLink board: the board's own candidates, never "across boards"
            if usable(gpus):
                out.append(self._across(gpus))
        return sorted(out, key=lambda s: (len({self.gpus[i].arch for i in s.gpus}), s.total_mib, s.gpus))

    def exact(self, gpus: tuple[int, ...]) -> GpuSet:
        """These cards as one set (a pinned model's): inside one board when they are, else across boards."""
        board = next((b for b in self.boards if set(gpus) <= set(b)), None)
        if board is not None and (len(gpus) == 1 or self._connected(gpus)):
            return self._set(gpus, board)
        return self._across(gpus)

    def board_unions(self, count: int, usable: Usable) -> list[GpuSet]:
        """The free parts of ``count`` boards together, for a model no single board holds: each board's free
        cards joined by NVLink, the boards joined by PCIe. Least memory first (the best fit), then fewer cards."""
        parts = []
        for board in self.boards:
            free = tuple(i for i in board if i not in self.taken)
            if free and (len(free) == 1 or self._connected(free)):
                parts.append(free)
        out = []
        for chosen in combinations(parts, count):
            gpus = tuple(sorted(i for part in chosen for i in part))
            if usable(gpus):
                out.append(self._across(gpus))
        return sorted(out, key=lambda s: (s.total_mib, s.size, s.gpus))

    @property
    def board_count(self) -> int:
        """Boards with a free card."""
        return sum(1 for board in self.boards if any(i not in self.taken for i in board))

    def largest_free_board(self, usable: Usable | None = None) -> GpuSet | None:
        """The free part of a board with the most memory (for expert offload), fewer cards on a tie."""
        sets = []
        for board in self.boards:
            free = tuple(i for i in board if i not in self.taken and (usable is None or usable((i,))))
            if free and (len(free) == 1 or self._connected(free)) and (usable is None or usable(free)):
                sets.append(self._set(free, board))
        return max(sets, key=lambda s: (s.total_mib, -s.size, -s.gpus[0]), default=None)

    @property
    def max_board(self) -> int:
        return max((len(board) for board in self.boards), default=0)

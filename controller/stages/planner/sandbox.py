"""What the sandbox of a Linux service opens and forbids: its cards' device nodes, and writable+executable memory.

The unit (roles/llama_service) closes the device list and opens only what is decided here, and turns
``MemoryDenyWriteExecute=`` on where this says nothing is compiled at run time. What a CUDA llama-server did on
the recorded H100 (under strace; ../shared/fixtures/gpu-h100-580/): it opened ``/dev/nvidiactl``, ``/dev/nvidia<minor>``
and ``/dev/nvidia-uvm``, and never had a mapping writable and executable at once, because the build carried
machine code for the card; a build without it has the driver compile the PTX at start, in such memory.
"""

from __future__ import annotations

from collections.abc import Sequence

from controller.model.catalog import EngineEntry
from controller.model.profile import Gpu
from controller.model.rules import arch_label


def device_minors(cards: Sequence[Gpu]) -> tuple[list[int], list[str]]:
    """The minor numbers of the cards' device nodes, in the cards' order, and the reasons (a warning for a guess).

    A profile probed before minor numbers were recorded has none: the card's index is taken, which is right on
    most boxes but not all (the driver numbers its nodes in the order it found the cards, nvidia-smi by PCI bus).
    """
    if not cards:
        return [], []
    minors = [card.index if card.minor_number is None else card.minor_number for card in cards]
    nodes = ", ".join(f"/dev/nvidia{minor}" for minor in minors)
    reasons = [f"device nodes {nodes} (each card's minor number), /dev/nvidiactl and /dev/nvidia-uvm: the unit "
               f"opens no other device; a boot unit makes them before the server starts"]
    guessed = [card.index for card in cards if card.minor_number is None]
    if guessed:
        which = ", ".join(map(str, guessed))
        reasons.append(f"warning: the profile records no minor number for GPU {which} (probed before minor numbers "
                       f"were recorded), so its index was taken as its device node's minor number; probe the box again "
                       f"to record it, or the unit may open another card's node")
    return minors, reasons


def deny_write_execute(engine: EngineEntry, cards: Sequence[Gpu]) -> tuple[bool, str]:
    """Whether the unit may refuse memory both writable and executable (``MemoryDenyWriteExecute=``), and why."""
    archs = engine.cuda_archs or []
    if not cards:
        if engine.cpu_only:
            return True, "MemoryDenyWriteExecute=yes: a CPU build compiles nothing at run time"
        return False, (f"MemoryDenyWriteExecute off: {engine.id} is a CUDA build serving without a card of its own; "
                       f"only a build carrying machine code for its card is known to compile nothing at run time")
    built = ", ".join(map(str, archs)) or "none"
    missing = [card for card in cards if card.arch is None or card.arch not in archs]
    if missing:
        card = missing[0]
        arch = arch_label(card.arch) if card.arch is not None else "unknown architecture"
        return False, (f"MemoryDenyWriteExecute off: {engine.id} carries no machine code for GPU {card.index}'s "
                       f"{arch} exactly (cuda_archs: {built}), so the driver may compile for it at start, in memory "
                       f"that is writable and executable")
    labels = ", ".join(sorted({arch_label(card.arch) for card in cards if card.arch is not None}))
    return True, (f"MemoryDenyWriteExecute=yes: {engine.id} carries machine code for {labels} (cuda_archs: {built}), "
                  f"so the driver compiles nothing at run time and no memory need be writable and executable")

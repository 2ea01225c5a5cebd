"""``systemctl show`` output, as ``llama_box_state``, ``llama_burn_in`` and ``box_manifest`` read it on the box."""

from __future__ import annotations


def show_properties(text):
    """One dict of ``Key=value`` properties per unit, in the order the units were asked.

    ``systemctl show`` prints a block per unit, blocks separated by a blank line; a value keeps any ``=`` after the
    first. No output gives one empty block.
    """
    return [dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
            for block in text.strip("\n").split("\n\n")]

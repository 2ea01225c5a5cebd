"""Compute capability of the GPUs a V100 box may hold, for when nvidia-smi does not report it.

Old drivers (before R510) have no ``compute_cap`` query field, and the default table never shows it.
The planner only builds for sm_70, so it must tell a V100 from the RTX 3090 beside it; a name this
table does not know is reported as an unknown GPU instead of being guessed.
"""

from __future__ import annotations

import re

# First match wins: put the more specific patterns before the ones they contain (A100 before A10).
_KNOWN: tuple[tuple[str, str], ...] = (
    (r"\bV100S?\b|\bTITAN V\b|\bQuadro GV100\b", "7.0"),
    (r"\bT4\b|\bRTX 20\d0|\bTITAN RTX\b|\bQuadro RTX\b|\bGTX 16\d0\b|\bT[1-9]\d{2,3}\b", "7.5"),
    (r"\bA100\b|\bA800\b|\bA30\b", "8.0"),
    (r"\bRTX 30\d0|\bA10G?\b|\bA40\b|\bA16\b|\bA2\b|\bRTX A\d{4}\b", "8.6"),
    (r"\bRTX 40\d0|\bL4\b|\bL40S?\b|\bRTX \d{4} Ada\b", "8.9"),
    (r"\bH100\b|\bH200\b|\bGH200\b|\bH800\b", "9.0"),
    (r"\bB200\b|\bB100\b|\bGB200\b", "10.0"),
    (r"\bRTX 50\d0|\bRTX PRO \d{4}\b", "12.0"),
    (r"\bP100\b", "6.0"),
    (r"\bP40\b|\bP4\b|\bGTX 10\d0|\bTITAN Xp?\b", "6.1"),
    (r"\bK80\b", "3.7"),
    (r"\bM40\b|\bM60\b|\bGTX 9\d0\b", "5.2"),
)


def known_compute_capability(name: str) -> str | None:
    """The "7.0"-form compute capability for a GPU name nvidia-smi prints, or None if unknown."""
    for pattern, capability in _KNOWN:
        if re.search(pattern, name, re.IGNORECASE):
            return capability
    return None

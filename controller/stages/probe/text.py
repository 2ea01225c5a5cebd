"""Shared plumbing for the probe parsers: clean lines with their original numbers, and warnings.

Every parser reads text that people paste or that a remote shell returns: CRLF line ends, ANSI
colour codes, a stray ``# fixture:`` provenance line on test files. Cleaning it in one place keeps
each parser about its format, and keeping the original line numbers lets a warning point the
operator at the exact line that was wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

FIXTURE_HEADER_PREFIX = "# fixture:"
"""A first line starting with this says where a test fixture came from; parsers skip it."""

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]")
# Control characters other than tab: left over from binary garbage or terminal captures.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")

PLACEHOLDERS = frozenset(
    {"", "n/a", "[n/a]", "na", "[not supported]", "not supported", "[unknown error]", "err!", "[err!]",
     "[gpu requires reset]", "[insufficient permissions]", "unknown", "[unknown]", "none", "-"}
)
"""Values nvidia-smi prints instead of a reading; they mean "no value", never a value."""


@dataclass(frozen=True)
class Line:
    number: int  # 1-based, counted in the file as given (the fixture header line counts)
    text: str


def clean_lines(text: str) -> list[Line]:
    """Split ``text`` into lines without CR, ANSI escapes or control characters, numbered from 1."""
    raw = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if raw and raw[-1] == "":
        raw.pop()
    lines: list[Line] = []
    for number, line in enumerate(raw, start=1):
        if number == 1:
            line = line.lstrip("\ufeff")
            if line.startswith(FIXTURE_HEADER_PREFIX):
                continue
        lines.append(Line(number, _CONTROL.sub("", _ANSI.sub("", line))))
    return lines


def has_content(text: str) -> bool:
    """True when the text holds anything besides blank lines and a fixture header line."""
    return any(line.text.strip() for line in clean_lines(text))


def is_placeholder(value: str | None) -> bool:
    return value is None or value.strip().lower() in PLACEHOLDERS


def looks_binary(text: str) -> bool:
    """True when the text is mostly undecodable or control bytes rather than a command's output."""
    if not text:
        return False
    sample = text[:4096]
    bad = sum(1 for char in sample if char == "\ufffd" or (ord(char) < 32 and char not in "\t\r\n"))
    return bad > max(8, len(sample) // 20)


@dataclass
class Warnings:
    """Collects the problems found while parsing; each names the file and, where known, the line."""

    items: list[str] = field(default_factory=list)

    def add(self, file: str, line: int | None, message: str) -> None:
        where = f"{file} line {line}" if line else file
        text = f"{where}: {message}"
        if text not in self.items:
            self.items.append(text)


def shorten(text: str, limit: int = 60) -> str:
    """Quote a bit of offending input in a warning without flooding it."""
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def readable(text: str, warnings: Warnings, file: str) -> bool:
    """True when ``text`` is worth parsing: it has content and is not binary (which is warned about)."""
    if not has_content(text):
        return False
    if looks_binary(text):
        warnings.add(file, None, "is not text (binary data); ignored")
        return False
    return True

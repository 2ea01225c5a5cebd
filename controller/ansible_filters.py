"""Jinja filters the roles use; plugins/filter/v100box.py only registers them."""

from __future__ import annotations

from collections.abc import Iterable

from controller import facts


def systemd_quote(word: str) -> str:
    """Quote one argument for a systemd ExecStart= line.

    systemd expands ``%`` specifiers and ``$VAR`` references and splits on whitespace, so every
    argument is double-quoted with ``\\``, ``"``, ``%`` and ``$`` escaped.
    """
    escaped = str(word).replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


def systemd_command(words: Iterable[str]) -> str:
    """An argument list as one ExecStart= value that systemd splits back into the same list."""
    return " ".join(systemd_quote(word) for word in words)


def reachable_host(bind: str) -> str:
    """The URL host that reaches, from the box itself, a server bound to ``bind`` (controller.facts decides)."""
    return facts.reachable_host(bind)


def filters() -> dict[str, object]:
    return {"systemd_quote": systemd_quote, "systemd_command": systemd_command, "reachable_host": reachable_host}

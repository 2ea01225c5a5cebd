"""What the modules that talk to a llama-server share: its server-sent event streams, the error message in an answer,
and an API key kept in a file on the box. Standard library only."""

from __future__ import annotations

import json


def sse_events(response):
    """``(event name, data)`` of each server-sent event ``response`` (anything with ``readline``) carries.

    ``data`` is the decoded JSON, or the text itself where it is not JSON (OpenAI's closing ``[DONE]``); the name is
    that of the ``event:`` line before it (Anthropic's stream sends one), or "" when there was none.
    """
    event = ""
    while True:
        line = response.readline()
        if not line:
            return
        line = line.decode("utf-8", "replace").rstrip("\r\n")
        if line.startswith("event:"):
            event = line[len("event:"):].strip()
        elif line.startswith("data:"):
            raw = line[len("data:"):].strip()
            try:
                data = json.loads(raw)
            except ValueError:
                data = raw
            yield event, data
            event = ""


def error_text(answer):
    """The error message in a decoded answer or stream event: OpenAI's and llama-server's ``{"error": {"message"}}``
    or ``{"error": "..."}``, Anthropic's ``{"type": "error", "error": {...}}``, or a bare ``{"code", "message"}``;
    "" when it carries none."""
    if not isinstance(answer, dict):
        return ""
    error = answer.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or json.dumps(error))
    if error:
        return str(error)
    return str(answer["message"]) if "code" in answer and answer.get("message") else ""


def http_error_text(exc):
    """The error message in the body of an HTTP error answer (``exc``: the HTTPError raised for it); "" when the body
    is not JSON or names no error."""
    try:
        return error_text(json.loads(exc.read() or b"{}"))
    except (ValueError, OSError, AttributeError):
        return ""


def read_key_file(path):
    """The API key in ``path``: its first line, stripped ("" for an empty file). Raises OSError."""
    with open(path, encoding="utf-8") as handle:
        return (handle.read().splitlines() or [""])[0].strip()

"""OpenClaw's config file (JSON5): the box's providers merged in, everything else kept.

The ``agent_clients`` role merges through the filters ``v100box.llm.openclaw_merge`` and ``openclaw_problem``; the
lab's OpenClaw runs merge the same way (``lab/openclaw.py``). json5 is imported on first use, so loading the filter
plugin (every forked worker does) costs nothing for it.
"""

from __future__ import annotations

import json
from typing import Any


class OpenClawConfigError(ValueError):
    """An existing OpenClaw config cannot be read as JSON5, or holds something else than an object where a provider
    goes; it is left as it was."""


def merge_openclaw(text: str, provider_id: str, provider: dict[str, Any], source: str = "the OpenClaw config") -> str:
    """The OpenClaw config ``text`` (JSON5) with ``provider`` set under models.providers; all else kept.

    The result is JSON (which JSON5 readers accept); comments of the original are not carried over. Models of an
    existing entry for ``provider_id`` that ``provider`` does not name stay, before its own.
    Refuses (OpenClawConfigError) text that is not JSON5, or whose ``models``/``models.providers`` is not an object.
    """
    import json5

    try:
        config = json5.loads(text) if text.strip() else {}
    except ValueError as exc:
        raise OpenClawConfigError(f"{source} is not valid JSON5 ({exc}); fix it or move it aside, it was left "
                                  f"untouched") from None
    if not isinstance(config, dict):
        raise OpenClawConfigError(f"{source} holds a {type(config).__name__}, not an object; it was left untouched")
    models = config.setdefault("models", {})
    providers = models.setdefault("providers", {}) if isinstance(models, dict) else None
    if not isinstance(providers, dict):
        raise OpenClawConfigError(f"{source}: models.providers is not an object; it was left untouched")
    models.setdefault("mode", "merge")  # keep OpenClaw's built-in providers beside this one
    existing = providers.get(provider_id) if isinstance(providers.get(provider_id), dict) else {}
    ours = {model["id"] for model in provider.get("models", [])}
    kept = [model for model in existing.get("models", []) if not (isinstance(model, dict) and model.get("id") in ours)]
    providers[provider_id] = {**existing, **provider, "models": kept + list(provider.get("models", []))}
    return json.dumps(config, indent=2, ensure_ascii=False) + "\n"

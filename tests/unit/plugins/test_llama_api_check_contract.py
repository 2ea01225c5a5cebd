"""llama_api_check has one contract on both OSes: the Windows module (.ps1) lists and sets the fields that the
Linux module documents in RETURN and returns, so llama_verify and the controller's verdict read the same answers."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import yaml

from tests.unit.windows.powershell import parse_errors

PLUGINS = Path(__file__).resolve().parents[3] / "ansible_collections/v100box/llm/plugins"
LINUX = PLUGINS / "modules" / "llama_api_check.py"
WINDOWS = PLUGINS / "modules" / "win_llama_api_check.ps1"
WINDOWS_DOC = PLUGINS / "modules" / "win_llama_api_check.py"
OPTIONS = PLUGINS / "doc_fragments" / "llama_api_check.py"  # both modules' documented options


def _module_constant(name: str, path: Path = LINUX) -> str:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path.name} has no {name}")


def linux_fields() -> dict[str, set[str]]:
    """Documented RETURN fields: top-level name -> names of its sub-fields (empty for a scalar or list)."""
    doc = yaml.safe_load(_module_constant("RETURN"))
    return {name: set(entry.get("contains") or {}) for name, entry in doc.items()}


def windows_listed_fields() -> dict[str, set[str]]:
    """The RETURN list in the .ps1's header comment: `#   name: type (sub, fields)`."""
    text = WINDOWS.read_text()
    block = text[text.index("# RETURN"):].split("\n\n", 1)[0]
    fields = {}
    for line in block.splitlines()[1:]:
        match = re.match(r"#\s+(\w+): \w+(?: \(([^)]*)\))?$", line)
        assert match, f"unreadable RETURN line in {WINDOWS.name}: {line!r}"
        fields[match.group(1)] = {part.strip() for part in (match.group(2) or "").split(",") if part.strip()}
    return fields


def windows_set_fields() -> dict[str, set[str]]:
    """What the .ps1 code puts into $module.Result (top level, and the keys of each hashtable it assigns)."""
    fields: dict[str, set[str]] = {}
    lines = WINDOWS.read_text().splitlines()
    for number, line in enumerate(lines):
        match = re.match(r"^(\s*)\$module\.Result\.(\w+) = (.*)$", line)
        if not match or match.group(2) == "changed":
            continue
        indent, name, value = match.groups()
        keys = fields.setdefault(name, set())
        if value.startswith("@{") and value.endswith("}"):  # inline: @{ a = 1; b = 2 }
            keys.update(re.findall(r"(\w+) = ", value))
        elif value == "@{":
            for inner in lines[number + 1:]:
                if inner == indent + "}":
                    break
                key = re.match(r"^\s+(\w+) = ", inner)
                if key:
                    keys.add(key.group(1))
    return fields


def test_both_modules_list_the_same_fields():
    assert windows_listed_fields() == linux_fields()
    assert set(yaml.safe_load(_module_constant("RETURN", WINDOWS_DOC))) == set(linux_fields())
    for path in (LINUX, WINDOWS_DOC):
        assert yaml.safe_load(_module_constant("DOCUMENTATION", path))["extends_documentation_fragment"] == \
            ["v100box.llm.llama_api_check"]


def test_the_windows_module_sets_every_listed_field():
    documented = linux_fields()
    assert windows_set_fields() == documented


def test_the_windows_module_takes_the_same_options_and_parses():
    assert parse_errors(WINDOWS.read_text()) == []
    options = set(yaml.safe_load(_module_constant("DOCUMENTATION", OPTIONS))["options"])
    spec = WINDOWS.read_text().split("options = @{", 1)[1].split("\n    }", 1)[0]
    assert set(re.findall(r"^\s+(\w+) = @\{", spec, re.M)) == options


def _linux_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("llama_api_check", LINUX)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_linux_module_returns_what_it_documents(monkeypatch):
    module = _linux_module()

    def call(base, path, headers, timeout, body=None):
        if path == "/v1/messages" and "tools" in body:
            return {"type": "message", "stop_reason": "tool_use",
                    "content": [{"type": "tool_use", "id": "t1", "name": "get_time", "input": {"timezone": "UTC"}}]}
        return {
            "/health": {"status": "ok"},
            "/v1/models": {"data": [{"id": "tiny"}]},
            "/v1/chat/completions": {"object": "chat.completion", "usage": {"completion_tokens": 3},
                                     "timings": {"prompt_n": 9, "prompt_per_second": 99.0, "predicted_n": 4,
                                                 "predicted_per_second": 12.345},
                                     "choices": [{"message": {"content": "hi"}}]},
            "/v1/messages": {"type": "message", "usage": {"output_tokens": 3}, "stop_reason": "max_tokens",
                             "content": [{"type": "text", "text": "hi"}]},
        }[path]

    streams = {"/v1/chat/completions": [{"object": "chat.completion.chunk"}, "[DONE]"],
               "/v1/messages": [{"type": "message_start"}, {"type": "message_stop"}]}
    checks = sys.modules[module.check.__module__]  # module_utils/api_check.py, where the module's checks live
    monkeypatch.setattr(checks, "call", call)
    monkeypatch.setattr(checks, "stream_events", lambda base, path, *args: iter(streams[path]))
    monkeypatch.setattr(checks, "status", lambda *args: 401)
    result, problems = module.check("http://127.0.0.1:1", "tiny", "k" * 20, "hi", 4, 5, certify_box=True,
                                    throughput_max_tokens=4)
    assert problems == []
    returned = {name: set(value) if isinstance(value, dict) else set() for name, value in result.items()}
    assert returned == linux_fields()
    assert result["tool_call"]["ok"] and result["streams"]["openai"]["ok"] and result["streams"]["anthropic"]["ok"]
    assert result["throughput"]["predicted_tokens"] == 4


def test_both_modules_certify_alike():
    """The same sub-fields of each stream's answer, the same tool and the same throughput prompt (the catalog's
    bands were measured with it, on either OS)."""
    module = sys.modules[_linux_module().check.__module__]  # module_utils/api_check.py: the Linux module's checks
    text = WINDOWS.read_text()
    for function, python in (("Test-OpenAIStream", module.check_openai_stream),
                             ("Test-AnthropicStream", module.check_anthropic_stream)):
        body = text[text.index(f"function {function} {{"):]
        keys = set(re.findall(r"(\w+) = ", re.search(r"\$result = @\{([^\n]*)\}", body).group(1)))
        answered = python("http://127.0.0.1:9", "tiny", {}, 1, 1)  # nothing listens there: the failure's fields
        assert keys == set(answered), function
    block = text[text.index("$throughputPrompt = ("):]
    block = block[:block.index("\n)\n")]
    windows_prompt = "".join(part.replace("''", "'") for part in re.findall(r"'((?:[^']|'')*)'", block))
    assert windows_prompt == module.THROUGHPUT_PROMPT
    for value in (module.CERTIFY_TOOL["name"], module.CERTIFY_TOOL_PROMPT, module.CERTIFY_TOOL_RESULT,
                  f"$certifyToolMaxTokens = {module.CERTIFY_TOOL_MAX_TOKENS}", "$anthropicVersion = '2023-06-01'"):
        assert value in text, value

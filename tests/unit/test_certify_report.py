"""The buyer's certification report: every section in Markdown and HTML, absent parts said, hostile text escaped,
plots drawn from the burn-in's samples, the files written (and the buyer's copy the only one with keys)."""

from __future__ import annotations

import copy
import html
import json
import math
import re
import stat
from html.parser import HTMLParser
from pathlib import Path

import pytest

from controller.inventory import Inventory
from controller.reports import certify as certify_report

SECTION_TITLES = ["Summary", "Not checked", "Identity", "Installed", "Endpoints", "Throughput", "GPU memory vs plan",
                  "Burn-in", "Thermal guard", "Power limits", "Seal"]
HOSTILE = '<script>alert("x")</script>'


def full_report() -> dict:
    """A failed certification of a two-V100 box after a 10-minute burn-in: the shape certify writes
    (/tmp/helpers/report_schema.json of issue 13), with the thermal guard stopping a service once."""
    samples = []
    for step in range(121):
        t = step * 5.0
        core = 45 + 40 * (1 - math.exp(-t / 150)) + (3 if 300 <= t < 330 else 0)
        samples.append({"t": t, "gpus": [
            {"index": 0, "temp_c": round(core, 1), "memory_temp_c": round(core + 4, 1), "power_w": 98.0,
             "power_limit_w": 100.0, "sm_clock_mhz": 1380, "mem_clock_mhz": 877,
             "throttle": ["sw_thermal"] if 300 <= t < 330 else []},
            {"index": 1, "temp_c": round(core - 6, 1), "memory_temp_c": None, "power_w": 96.5,
             "power_limit_w": 100.0, "sm_clock_mhz": 1380, "mem_clock_mhz": 877, "throttle": []}]})
    series = {"gemma4-26b": [{"t": 2.0 + 6 * i, "tok_s": 99.0 - (40 if 300 <= 6 * i < 336 else 0) + (i % 3)}
                             for i in range(100)],
              "qwen3-35b": [{"t": 3.0 + 6 * i, "tok_s": 54.0 + (i % 4)} for i in range(100)]}
    return {
        "box": "box3", "address": "192.0.2.10", "passed": False, "generated": "2026-11-24T03:00:00+00:00",
        "certify_version": 1,
        "checks": [
            {"name": "identity", "section": "identity", "passed": True, "detail": "2 GPUs seen: Tesla V100-SXM2-32GB"},
            {"name": "endpoint gemma4-26b", "section": "endpoints", "passed": True,
             "detail": "health ok; serves gemma4-26b; tool call round trip; streaming on both"},
            {"name": "throughput gemma4-26b", "section": "throughput", "passed": False,
             "detail": "generation 61.2 tok/s below the band 90-110 tok/s; likely causes: thermal throttling"},
            {"name": "burn-in", "section": "burn_in", "passed": False,
             "detail": "600 s; throttling seen on GPU 0 (sw_thermal)"},
            {"name": "thermal guard", "section": "thermal", "passed": True, "detail": "running; 2 events"},
            {"name": "power limits", "section": "power", "passed": True, "detail": "100 W on both cards"},
        ],
        "not_checked": [{"name": "PCIe link width", "why": "the driver does not report it on this box"}],
        "identity": {
            "gpus": [{"index": i, "name": "Tesla V100-SXM2-32GB", "uuid": f"GPU-3f2a9c1e-0000-4000-8000-00000000000{i}",
                      "serial": f"032161800{i}123", "memory_mib": 32768, "pci_bus_id": f"00000000:{0x1A + i:02X}:00.0",
                      "power_limit_w": 100.0} for i in range(2)],
            "driver": {"version": "580.82.07", "cuda_version": "13.0", "model": None},
            "nvlink": [{"gpus": [0, 1], "links": 2}],
            "cpu": {"model": "AMD EPYC 7302P 16-Core Processor", "cores": 16, "threads": 32},
            "memory_mib": 131072,
            "disks": [{"name": "nvme0n1", "size_bytes": 1000204886016, "model": "Samsung SSD 980 PRO 1TB"}],
            "os": "Debian GNU/Linux 12 (bookworm)",
        },
        "installed": {
            "engines": [{"slot": "cuda", "version": "cuda-0c1e570", "previous": "cuda-9b8a7f6", "sha256": "c459" * 16}],
            "models": [{"file": "gemma-4-26b-a4b-qat-q4_0.gguf", "sha256": "568b" * 16, "size_bytes": 15_200_000_000,
                        "ok": True},
                       {"file": "Qwen3.6-35B-A3B-IQ4_XS.gguf", "sha256": "9e0d" * 16, "size_bytes": 18_900_000_000,
                        "ok": True}],
            "templates": [{"name": "gemma4-nothink.jinja", "sha256": "0d3e" * 16}],
            "units": [{"name": "llama-gemma4-26b.service", "active": True},
                      {"name": "llama-qwen3-35b.service", "active": True}],
            "plan": {"services": [
                {"name": "gemma4-26b", "model": "gemma4-26b-a4b-qat-q4_0", "engine": "cuda-0c1e570", "gpus": [0],
                 "ctx": 32768, "parallel": 1, "reasons": ["fits on one V100 with a q8_0 KV cache"]},
                {"name": "qwen3-35b", "model": "qwen3.6-35b-a3b-iq4_xs", "engine": "cuda-0c1e570", "gpus": [1],
                 "ctx": 65536, "parallel": 2, "reasons": ["offloads 12 expert layers to the CPU (--n-cpu-moe 12)"]}]},
            "lock": {"file": "fleet.lock.yml", "entry": {"engines": {"cuda-0c1e570": {"sha256": "c459" * 16}}}},
        },
        "endpoints": {
            "gemma4-26b": {"endpoint": "http://192.0.2.10:8001", "health": "ok", "served_ids": ["gemma4-26b"],
                           "openai": {"object": "chat.completion", "completion_tokens": 32, "tokens_per_second": 61.2},
                           "anthropic": {"type": "message", "output_tokens": 32, "stop_reason": "end_turn"},
                           "auth": {"required": True, "anonymous_status": 401, "wrong_key_status": 401},
                           "tool_call": {"ok": True, "tool_use": True, "tool_name": "get_weather",
                                         "stop_reason": "tool_use", "final_stop_reason": "end_turn", "detail": ""},
                           "streams": {"openai": {"ok": True, "chunks": 34, "done": True, "detail": ""},
                                       "anthropic": {"ok": True, "events": 40, "message_stop": True, "detail": ""}}},
            "qwen3-35b": {"endpoint": "http://192.0.2.10:8002", "health": "ok", "served_ids": ["qwen3-35b"],
                          "openai": {"object": "chat.completion", "completion_tokens": 32, "tokens_per_second": 55.0},
                          "anthropic": {"type": "message", "output_tokens": 32, "stop_reason": "end_turn"},
                          "tool_call": {"ok": True, "tool_use": True, "tool_name": "get_weather"},
                          "streams": {"openai": {"ok": True, "chunks": 33, "done": True},
                                      "anthropic": {"ok": True, "events": 39, "message_stop": True}}},
        },
        "throughput": [
            {"service": "gemma4-26b", "model": "gemma4-26b-a4b-qat-q4_0", "prompt_tok_s": 1450.0, "gen_tok_s": 61.2,
             "band": {"gen_tok_s": [90, 110], "prompt_tok_s": [1000, None],
                      "source": "seed measurement: one V100 in TCC, 99.8 tok/s", "hardware": "1x V100-SXM2-32GB"},
             "passed": False, "causes": ["thermal throttling (sw_thermal seen on GPU 0)"]},
            {"service": "qwen3-35b", "model": "qwen3.6-35b-a3b-iq4_xs", "prompt_tok_s": 420.0, "gen_tok_s": 55.3,
             "band": {"gen_tok_s": [50, 60], "prompt_tok_s": [300, None],
                      "source": "seed measurement: IQ4_XS offloading on one card, 54.5 tok/s",
                      "hardware": "1x V100-SXM2-32GB"}, "passed": True, "causes": []},
        ],
        "burn_in": {
            "duration_s": 600, "samples": samples, "series": series,
            "requests": {"gemma4-26b": {"ok": 100, "errors": 0, "messages": []},
                         "qwen3-35b": {"ok": 100, "errors": 0, "messages": []}},
            "boot_id": {"before": "5d1b", "after": "5d1b"},
            "restarts": {"gemma4-26b": {"before": 0, "after": 1, "invocation_changed": True},
                         "qwen3-35b": {"before": 0, "after": 0, "invocation_changed": False}},
            "problems": ["GPU 0 throttled (sw_thermal) from 300 s to 325 s"], "gpu_sampled": True,
        },
        "thermal_guard": {"installed": True, "active": True, "warn_c": 80, "stop_c": 85, "resume_c": 75, "events": [
            {"time": "2026-11-24T02:55:00+00:00", "kind": "stop", "gpu": 0, "temp_c": 86.0, "memory_temp_c": 90.0,
             "service": "llama-gemma4-26b", "message": "GPU 0 at 86 C: stopped llama-gemma4-26b"},
            {"time": "2026-11-24T02:55:30+00:00", "kind": "start", "gpu": 0, "temp_c": 74.0, "memory_temp_c": 78.0,
             "service": "llama-gemma4-26b", "message": "GPU 0 at 74 C: started llama-gemma4-26b"}]},
        "power": {"persistence": True, "limits": [{"gpu": 0, "watts": 100, "applied": True, "range": [100, 300]},
                                                   {"gpu": 1, "watts": 100, "applied": True, "range": [100, 300]}]},
        "seal": {"sealed": "2026-11-24T03:10:00+00:00", "removed": ["/root/.ssh/authorized_keys: builder key"],
                 "rotated_keys": ["gemma4-26b", "qwen3-35b"], "first_boot": {"ssh_host_keys": True, "machine_id": True}},
        "run": {"playbook": "certify.yml", "status": "successful", "elapsed": 641.2, "failed": []},
        "burn_in_s": 600,
        "reports": None,
    }


def minimal_report() -> dict:
    """What certify writes for a box it could barely read: no sections beyond the checks."""
    return {"box": "bare", "passed": False, "checks": [{"name": "reachable", "passed": False, "detail": "no answer"}],
            "not_checked": [{"name": "Burn-in", "why": "no --burn-in was given"},
                            {"name": "endpoints", "section": "endpoints", "why": "no service answered"}]}


class _Visible(HTMLParser):
    """The page's text a reader sees (outside <style>), and every element's tag."""

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.tags: list[str] = []
        self._style = False

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self._style = tag == "style"

    def handle_endtag(self, tag):
        self._style = False if tag == "style" else self._style

    def handle_data(self, data):
        if not self._style:
            self.text.append(data)


def _visible(page: str) -> tuple[str, list[str]]:
    parser = _Visible()
    parser.feed(page)
    return " ".join(" ".join(parser.text).split()), parser.tags


def _md_headings(text: str) -> list[str]:
    return [re.sub(r" — .*$", "", line[3:]) for line in text.splitlines() if line.startswith("## ")]


def _html_headings(page: str) -> list[str]:
    return [re.sub(r"<[^>]+>.*", "", heading).strip() for heading in re.findall(r"<h2>(.*?)</h2>", page)]


@pytest.mark.parametrize("build", [full_report, minimal_report])
def test_every_section_is_in_the_markdown_and_the_page(build):
    report = build()
    assert _md_headings(certify_report.markdown(report)) == SECTION_TITLES
    assert _html_headings(certify_report.html(report)) == SECTION_TITLES


def test_the_full_report_says_what_a_buyer_checks():
    report = full_report()
    text = certify_report.markdown(report)
    page, _ = _visible(certify_report.html(report))
    for shown in (text, page):
        assert "FAILED" in shown
        assert "GPU-3f2a9c1e-0000-4000-8000-000000000001" in shown and "0321618001123" in shown  # UUID, serial
        assert "568b" * 16 in shown and "c459" * 16 in shown  # model file and engine pack checksums
        assert "offloads 12 expert layers to the CPU" in shown  # the plan's reasons
        assert "90–110 tok/s" in shown and "seed measurement: one V100 in TCC, 99.8 tok/s" in shown  # band, source
        assert "thermal throttling (sw" in shown  # the likely cause
        assert "GPU 0 at 86 C: stopped llama-gemma4-26b" in shown  # the guard's event
        assert "100–300 W" in shown  # the power limit's range
        assert "the driver does not report it on this box" in shown  # not checked, and why
        assert "get" in shown and "weather" in shown and "tool" in shown  # the tool call round trip
        assert "0 → 1, new invocation" in shown  # the restart during the burn-in
        assert "certify.yml: successful in 641.2 s" in shown
    rows = [line for line in text.splitlines() if line.startswith("| throughput gemma4-26b")]
    assert rows and "**FAIL**" in rows[0]


def test_absent_sections_say_why_they_were_not_checked():
    report = minimal_report()
    text = certify_report.markdown(report)
    page, _ = _visible(certify_report.html(report))
    for shown in (text, page):
        assert "not checked: no \\-\\-burn-in was given" in shown or "not checked: no --burn-in was given" in shown
        assert "not checked: no service answered" in shown
        assert "not checked: the report holds no identity data" in shown
        assert "not sealed yet" in shown


def test_hostile_text_from_the_box_is_escaped():
    report = full_report()
    report["identity"]["gpus"][0]["name"] = HOSTILE
    report["checks"][0]["detail"] = HOSTILE
    report["not_checked"][0]["why"] = HOSTILE
    report["thermal_guard"]["events"][0]["message"] = HOSTILE
    report["burn_in"]["series"] = {HOSTILE + " $x$": report["burn_in"]["series"]["gemma4-26b"]}
    report["box"] = "<b>box</b>"
    page = certify_report.html(report)
    text, tags = _visible(page)
    assert "script" not in tags and "b" not in tags
    assert text.count(HOSTILE) >= 4  # shown as text, in the tables and the plot's legend
    assert "<script" not in page
    markdown = certify_report.markdown(report)
    assert "<script>" not in markdown and "\\<script\\>" in markdown


def test_a_cell_with_a_pipe_or_a_newline_keeps_its_markdown_table_row():
    report = full_report()
    report["checks"][0]["detail"] = "a | b\nc"
    row = next(line for line in certify_report.markdown(report).splitlines() if line.startswith("| identity |"))
    assert len(re.split(r"(?<!\\)\|", row)) == 6 and "a \\| b c" in row  # 4 cells, the pipe escaped


def _commonmark(text: str) -> str:
    """Markdown as a CommonMark viewer with GFM tables shows it (markdown-it-py comes with rich)."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable("table").render(text)


IMG = "<img src=x onerror=alert(1)>"


@pytest.mark.parametrize("value", [
    f"a``{IMG}``b",  # two backticks closed the double-backtick span this used to get
    f"`{IMG}`",
    f"```{IMG}`` `",
    f"x\\`{IMG}`",  # a backslash escapes nothing inside a code span
    f"{IMG}` | c\n``",  # a pipe and a newline as well
])
def test_a_value_with_backticks_cannot_end_its_code_span(value):
    report = full_report()
    report["identity"]["gpus"][0]["uuid"] = value
    report["installed"]["models"][0]["file"] = value
    report["thermal_guard"]["events"][0]["service"] = value

    page = _commonmark(certify_report.markdown(report))

    _, tags = _visible(page)
    assert "img" not in tags and "<img" not in page
    codes = [html.unescape(code) for code in re.findall(r"<code>(.*?)</code>", page, re.S)]
    assert codes.count(" ".join(value.split())) == 3  # each value whole, in one span, in its own cell
    page_text, page_tags = _visible(certify_report.html(report))
    assert "img" not in page_tags and page_text.count(" ".join(value.split())) == 3


def test_a_preformatted_block_has_a_fence_no_line_of_it_closes():
    text = "{\n```\n ~~~~\n````" + IMG + "\n}"

    page = _commonmark("\n".join(certify_report._md_block(certify_report.Pre(text))))

    assert "<img" not in page and html.unescape(page).count(IMG) == 1
    assert re.fullmatch(r'<pre><code class="language-json">.*</code></pre>\s*', page, re.S)


def test_plots_are_svg_drawn_from_the_samples():
    report = full_report()
    svgs = certify_report.plots(report)
    assert set(svgs) == {"temperatures", "throughput"}
    for svg in svgs.values():
        assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
        assert "<?xml" not in svg and not re.search(r'(?:href|src)="(?!#)', svg)  # nothing fetched, no links out
    assert "GPU 0 core" in svgs["temperatures"] and "GPU 0 memory" in svgs["temperatures"]
    assert "GPU 1 core" in svgs["temperatures"] and "GPU 1 memory" not in svgs["temperatures"]  # HBM not reported
    assert "guard stops (85 °C)" in svgs["temperatures"]
    assert "gemma4-26b" in svgs["throughput"] and "qwen3-35b" in svgs["throughput"]
    assert "minutes" in svgs["temperatures"]  # a 10-minute burn-in is plotted in minutes
    ids = re.findall(r'\bid="([^"]+)"', "".join(svgs.values()))
    referenced = set(re.findall(r'url\(#([^)]+)\)|xlink:href="#([^"]+)"', "".join(svgs.values())))
    assert all(ids.count(name) == 1 for pair in referenced for name in pair if name)  # inline SVGs keep apart
    page = certify_report.html(report, svgs)
    assert page.count("<svg") == 2


def test_no_plot_without_samples_and_the_report_says_why():
    report = full_report()
    for gpu in (g for sample in report["burn_in"]["samples"] for g in sample["gpus"]):
        gpu["temp_c"] = gpu["memory_temp_c"] = None
    report["burn_in"]["gpu_sampled"] = False
    assert set(certify_report.plots(report)) == {"throughput"}
    assert "No GPU temperature was sampled" in certify_report.markdown(report)
    page = certify_report.html(report)
    assert page.count("<svg") == 1 and "No GPU temperature was sampled" in page
    assert certify_report.plots(minimal_report()) == {}
    assert "No burn-in ran" in certify_report.plot_gaps(minimal_report())["temperatures"]


def test_write_reports_names_its_files_in_the_json(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(certify_report, "browser", lambda: None)  # the PDF is the integration test's
    report = full_report()
    paths = certify_report.write_reports(Inventory(tmp_path), report)
    folder = (tmp_path / "reports").resolve()
    assert paths == {"markdown": str(folder / "box3.certify.md"), "json": str(folder / "box3.certify.json"),
                     "html": str(folder / "box3.certify.html"), "pdf": None, "pdf_note": paths["pdf_note"]}
    assert "no Chromium on PATH" in paths["pdf_note"]
    written = json.loads((folder / "box3.certify.json").read_text())
    assert written["reports"] == paths and written["passed"] is False
    assert _md_headings((folder / "box3.certify.md").read_text()) == SECTION_TITLES
    assert (folder / "box3.certify.html").read_text().count("<svg") == 2


def test_the_buyer_copy_alone_holds_the_keys(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(certify_report, "browser", lambda: None)
    report = full_report()
    keys = {"gemma4-26b": "sk-buyer-0123456789abcdef", "qwen3-35b": "sk-buyer-fedcba9876543210"}
    certify_report.write_reports(Inventory(tmp_path), report)
    before = copy.deepcopy(report)
    copies = certify_report.write_buyer_copy(tmp_path, report, keys)
    assert report == before  # the report dict the JSON is written from never gains the keys
    assert sorted(Path(path).name for path in copies.values()) == ["box3.buyer.html", "box3.buyer.md"]
    for path in copies.values():
        text = Path(path).read_text()
        assert all(key in text for key in keys.values()) and "API keys" in text
        assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600
    for path in tmp_path.rglob("*"):
        if path.is_file() and not path.name.startswith("box3.buyer."):
            assert not any(key in path.read_text() for key in keys.values()), path.name


# ---------------------------------------------------------------- issue 21: what a buyer reads


def _with_bursts(report: dict) -> dict:
    """Two one-token bursts among the burn-in's requests: a request whose two tokens came in one chunk has a rate
    of hundreds of thousands of tok/s (seen on the lab box: 407,806 tok/s against a median of 925)."""
    series = report["burn_in"]["series"]["gemma4-26b"]
    series[10]["tok_s"], series[41]["tok_s"] = 407806.0, 120000.0
    return report


def _numbers(svg: str) -> list[float]:
    """The numbers the plot writes as text (its tick labels)."""
    return [float(text.replace("\u2212", "-")) for text in re.findall(r">\s*([\u22120-9.]+)\s*</text>", svg)]


def test_burn_in_rates_are_over_windows_of_requests_and_ignore_one_token_bursts():
    points = [(float(i), 100.0 + (i % 3)) for i in range(23)]
    points[4] = (4.0, 407806.0)
    windows = certify_report.windowed_rates(points)
    assert len(windows) == 4 and all(99 <= rate <= 103 for _, rate in windows)  # the 3 left over join the last
    assert [t for t, _ in windows] == sorted(t for t, _ in windows)
    assert certify_report.windowed_rates([]) == []
    assert certify_report.windowed_rates([(1.0, 50.0)]) == [(1.0, 50.0)]


def test_the_tok_s_plot_is_scaled_to_the_bulk_of_the_rates_not_to_a_burst():
    report = _with_bursts(full_report())
    svg = certify_report.plots(report)["throughput"]
    assert max(_numbers(svg)) <= 200  # the rates are about 60 to 100 tok/s; the bursts are 407,806 and 120,000
    text = certify_report.markdown(report)
    assert "407806" not in text and "120000" not in text
    assert "median of each 5 requests" in text
    row = next(line for line in text.replace("\\", "").splitlines() if line.startswith("| gemma4-26b | 100 |"))
    low, median, high = (float(part) for part in row.split("|")[4].split("/"))
    assert 55 <= low <= median <= high <= 101


def test_an_axis_that_leaves_windows_out_says_so():
    report = full_report()
    for point in report["burn_in"]["series"]["gemma4-26b"][30:33]:  # three bursts in a row beat a window's median
        point["tok_s"] = 250000.0
    svg = certify_report.plots(report)["throughput"]
    assert max(_numbers(svg)) <= 200
    assert "above the axis" in certify_report.markdown(report)


def test_the_lock_and_the_servers_timings_read_as_tables_not_json():
    report = full_report()
    report["installed"]["lock"] = {
        "definition": {"models": [{"id": "gemma4-26b-a4b-qat-q4_0", "ctx": 32768}], "bind": "127.0.0.1"},
        "driver": {"manage": True, "branch": 580, "installed": "580.82.07"},
        "engines": {"cuda-0c1e570": {"slot": "cuda", "commit": "0c1e570", "platform": "linux-x86_64",
                                     "file": "llama-0c1e570-cuda.tar.gz", "sha256": "c459" * 16}},
        "models": {"gemma-4-26b-a4b-qat-q4_0.gguf": {"id": "gemma4-26b-a4b-qat-q4_0", "sha256": "568b" * 16,
                                                     "size_bytes": 15_200_000_000}},
        "templates": {"gemma4-nothink.jinja": {"sha256": "0d3e" * 16}},
        "services": {"llama-gemma4-26b": {"model": "gemma4-26b-a4b-qat-q4_0", "engine": "cuda-0c1e570",
                                          "host": "127.0.0.1", "port": 8001, "args": ["--ctx-size", "32768"],
                                          "env": {"CUDA_VISIBLE_DEVICES": "0"}, "template": None}},
        "gateway": None}
    report["endpoints"]["gemma4-26b"]["throughput"] = {"prompt_tokens": 200, "prompt_per_second": 900.0,
                                                        "predicted_tokens": 64, "predicted_per_second": 50.0,
                                                        "detail": ""}
    text = certify_report.markdown(report)
    page = certify_report.html(report)
    installed = text[text.index("## Installed"):text.index("## Endpoints")].replace("\\", "")  # escapes aside
    assert "```" not in installed and '"sha256"' not in installed and "{" not in installed
    assert "| `gemma-4-26b-a4b-qat-q4_0.gguf` | gemma4-26b-a4b-qat-q4_0 | `" + "568b" * 16 + "` |" in installed
    assert "--ctx-size 32768" in installed and "CUDA_VISIBLE_DEVICES=0" in installed
    section = page[page.index('id="installed"'):page.index('id="endpoints"')]
    assert "<pre" not in section and section.count("<table") >= 8
    endpoints, _ = _visible(page[page.index('id="endpoints"'):page.index('id="throughput"')])
    assert "predicted_per_second" not in endpoints and "{" not in endpoints
    assert "prompt 200 tokens at 900 tok/s; generation 64 tokens at 50 tok/s" in endpoints


def test_model_files_as_status_reads_them_keep_names_and_hashes_whole_in_fixed_columns():
    report = full_report()
    report["installed"]["models"] = [
        {"file": "gemma-4-26B-A4B-it-qat-q4_0-unsloth-UD-Q4_K_XL-00001-of-00002.gguf",
         "path": "/var/lib/llama/models/gemma-4-26B-A4B-it-qat-q4_0-unsloth-UD-Q4_K_XL-00001-of-00002.gguf",
         "size_bytes": 15_200_000_000, "sha256": "568b" * 16, "recorded_sha256": "568b" * 16,
         "locked_sha256": "9999" * 16, "ok": True}]
    text = certify_report.markdown(report)
    header = next(line for line in text.splitlines() if line.startswith("| File |"))
    assert "Install record" in header and "Lock" in header and "recorded" not in header
    row = next(line for line in text.splitlines() if line.startswith("| `gemma-4-26B"))
    assert row.count("568b" * 16) == 1 and "matches" in row and "`" + "9999" * 16 + "`" in row  # the lock differs
    page = certify_report.html(report)
    assert "table-layout: fixed" in page and "overflow-wrap: anywhere" in page
    table = page[page.index("<th>File</th>") - 400:page.index("<th>File</th>")]
    widths = [float(width) for width in re.findall(r'<col style="width: ([0-9.]+)%">', table)]
    assert len(widths) == 7 and abs(sum(widths) - 100) < 0.5 and min(widths) >= 4

"""The buyer's HTML report in a real browser: Debian's headless Chromium opens the page and prints it.

The screenshots are kept as test artefacts in ``$V100BOX_ARTIFACTS/certify-html/`` when that is set, else in
``tests/artifacts/certify-html/`` (ignored by git); the test prints where.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from controller.inventory import Inventory
from controller.reports import certify as certify_report
from tests.unit.test_certify_report import full_report

pytestmark = [pytest.mark.browser]

PROJECT = Path(__file__).resolve().parents[2]
WIDTH, HEIGHT = 1200, 2400
FAIL_RED = (0xCF, 0x22, 0x2E)  # the FAILED badge (the page's --fail colour)
PLOT_BLUE = (0x1F, 0x77, 0xB4)  # matplotlib's first line colour: GPU 0 and the first service


@pytest.fixture(scope="module")
def chromium() -> str:
    found = certify_report.browser()
    if found is None:
        reason = "no chromium or chromium-browser on PATH; run ./scripts/bootstrap.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(f"Chromium is required in CI: {reason}", pytrace=False)
        pytest.skip(reason)
    return found


@pytest.fixture(scope="module")
def artifacts() -> Path:
    folder = Path(os.environ.get("V100BOX_ARTIFACTS") or PROJECT / "tests" / "artifacts") / "certify-html"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _screenshot(chromium: str, page: Path, png: Path, profile: Path, height: int) -> Image.Image:
    done = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={profile}", "--hide-scrollbars", f"--screenshot={png}",
                           f"--window-size={WIDTH},{height}", page.as_uri()],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and png.is_file(), done.stderr[-2000:]
    return Image.open(png).convert("RGB")


def _has_colour(image: Image.Image, colour: tuple[int, int, int], box: tuple[int, int, int, int]) -> bool:
    region = image.crop(box)
    return colour in {found for _, found in region.getcolors(region.width * region.height)}


def test_the_report_opens_in_chromium_and_prints_to_pdf(chromium, artifacts, tmp_path):
    reports = certify_report.write_reports(Inventory(tmp_path), full_report())
    page = Path(reports["html"])

    png = artifacts / "box3.certify.png"
    image = _screenshot(chromium, page, png, tmp_path / "profile", HEIGHT)
    print(f"screenshot: {png}")
    assert image.size == (WIDTH, HEIGHT)
    assert png.stat().st_size > 50_000  # a rendered page of tables and text, not a blank one
    assert _has_colour(image, FAIL_RED, (0, 0, WIDTH, 150))  # the FAILED badge in the header, styled

    whole = artifacts / "box3.certify-whole.png"
    image = _screenshot(chromium, page, whole, tmp_path / "profile", 7000)
    print(f"whole page: {whole}")
    assert _has_colour(image, PLOT_BLUE, (0, HEIGHT, WIDTH, 7000))  # the inline SVG plots were drawn

    assert reports["pdf"] is not None, reports["pdf_note"]
    pdf = Path(reports["pdf"]).read_bytes()
    assert pdf.startswith(b"%PDF-") and len(pdf) > 20_000 and pdf.rstrip().endswith(b"%%EOF")
    assert len(re.findall(rb"/Type\s*/Page\b(?!s)", pdf)) >= 2  # the long page printed over several sheets
    shutil.copy(reports["pdf"], artifacts / "box3.certify.pdf")
    assert (tmp_path / "reports" / "box3.certify.json").read_text().count(reports["pdf"]) == 1


# What the page measures of itself in Chromium at 1200 px: a copy of the page without its Content-Security-Policy
# (which forbids scripts, rightly) and with this script at its end; --dump-dom prints the DOM after it ran.
MEASURE = """<script>
const found = [];
for (const el of document.querySelectorAll("table, th, td, dl, dd, pre, figure")) {
  if (el.scrollWidth > el.clientWidth + 1) found.push(["overflows", el.tagName, el.textContent.slice(0, 60)]);
}
for (const table of document.querySelectorAll("table")) {
  if (table.offsetWidth > table.parentElement.clientWidth + 1) found.push(["wider than the page", table.offsetWidth]);
}
for (const cell of document.querySelectorAll("td")) {  // squeezed to a letter a line: the file names of issue 21
  if (cell.textContent.trim().length >= 8 && cell.clientWidth < 72) found.push(["squeezed", cell.textContent, cell.clientWidth]);
}
const page = document.documentElement;
if (page.scrollWidth > window.innerWidth) found.push(["page scrolls sideways", page.scrollWidth, window.innerWidth]);
const out = document.createElement("pre");
out.id = "measured";
out.textContent = JSON.stringify({found: found, width: window.innerWidth, tables: document.querySelectorAll("table").length});
document.body.appendChild(out);
</script>"""


def issue21_report() -> dict:
    """The full report as a real certify writes it where issue 21 saw it go wrong: model files as status reads them
    (a long split file name, its path, three checksums), the lock entry, the servers' own timings, a model whose
    tool calls were not checked, and one-token bursts in the burn-in's rates."""
    report = full_report()
    name = "gemma-4-26B-A4B-it-qat-q4_0-unsloth-UD-Q4_K_XL-00001-of-00002.gguf"
    report["installed"]["models"] = [
        {"file": name, "path": f"/var/lib/llama/models/{name}", "size_bytes": 15_200_000_000, "sha256": "568b" * 16,
         "recorded_sha256": "568b" * 16, "locked_sha256": "568b" * 16, "ok": True},
        {"file": "Qwen3.6-35B-A3B-IQ4_XS.gguf", "path": "/var/lib/llama/models/Qwen3.6-35B-A3B-IQ4_XS.gguf",
         "size_bytes": 18_900_000_000, "sha256": "9e0d" * 16, "recorded_sha256": None, "locked_sha256": "1f2e" * 16,
         "ok": False}]
    report["installed"]["engines"][0].update(id="cuda-0c1e570", planned="0c1e570", running="0c1e570", locked="0c1e570")
    report["installed"]["lock"] = {
        "definition": {"models": [{"id": "gemma4-26b-a4b-qat-q4_0", "ctx": 32768}], "bind": "127.0.0.1"},
        "driver": {"manage": True, "branch": 580, "installed": "580.82.07"},
        "engines": {"cuda-0c1e570": {"slot": "cuda", "commit": "0c1e570", "platform": "linux-x86_64",
                                     "file": "llama-0c1e570-bin-linux-cuda-x64.tar.gz", "sha256": "c459" * 16}},
        "models": {name: {"id": "gemma4-26b-a4b-qat-q4_0", "sha256": "568b" * 16, "size_bytes": 15_200_000_000}},
        "templates": {"gemma4-nothink.jinja": {"sha256": "0d3e" * 16}},
        "services": {"llama-gemma4-26b": {
            "model": "gemma4-26b-a4b-qat-q4_0", "engine": "cuda-0c1e570", "host": "127.0.0.1", "port": 8001,
            "args": ["--model", f"/var/lib/llama/models/{name}", "--ctx-size", "32768", "--cache-type-k", "q8_0",
                     "--jinja", "--api-key-file", "/etc/llama/keys/llama-gemma4-26b.key"],
            "env": {"CUDA_VISIBLE_DEVICES": "0"}, "template": "gemma4-nothink.jinja"}},
        "gateway": None}
    for answer in report["endpoints"].values():
        answer["throughput"] = {"prompt_tokens": 200, "prompt_per_second": 1450.0, "predicted_tokens": 64,
                                "predicted_per_second": 61.2, "detail": ""}
    report["endpoints"]["qwen3-35b"]["tool_call"] = {"ok": False, "tool_use": False,
                                                     "detail": "no tool_use block: stop_reason end_turn"}
    report["not_checked"].append({"name": "tool call round trip qwen3-35b",
                                  "why": "the catalog says qwen3.6-35b-a3b-iq4_xs's chat template makes no tool calls"})
    series = report["burn_in"]["series"]["gemma4-26b"]
    series[10]["tok_s"], series[41]["tok_s"] = 407806.0, 120000.0
    return report


def test_at_1200_px_no_table_overflows_and_nothing_is_squeezed_to_a_letter(chromium, artifacts, tmp_path):
    reports = certify_report.write_reports(Inventory(tmp_path), issue21_report())
    page = Path(reports["html"])
    png = artifacts / "box3.certify-1200.png"
    _screenshot(chromium, page, png, tmp_path / "profile", 9000)
    print(f"screenshot at {WIDTH} px: {png}")

    text = page.read_text()
    policy = re.search(r'<meta http-equiv="Content-Security-Policy"[^>]*>\n?', text)
    assert policy is not None  # the real page runs no script; only this measuring copy does
    measured = tmp_path / "measured.html"
    measured.write_text(text.replace(policy.group(0), "").replace("</body>", MEASURE + "</body>"))
    done = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={tmp_path / 'profile-dom'}", "--hide-scrollbars",
                           f"--window-size={WIDTH},{HEIGHT}", "--dump-dom", measured.as_uri()],
                          capture_output=True, text=True, timeout=120, check=False)
    found = re.search(r'<pre id="measured">(.*?)</pre>', done.stdout, re.S)
    assert done.returncode == 0 and found, done.stderr[-2000:]
    result = json.loads(html.unescape(found.group(1)))
    assert result["width"] == WIDTH and result["found"] == [], result["found"]
    assert result["tables"] >= 15  # the lock is tables too, not a block of JSON

"""The buyer's HTML report in a real browser: Debian's headless Chromium opens the page and prints it.

The screenshots are kept as test artefacts in ``$V100BOX_ARTIFACTS/certify-html/`` when that is set, else in
``tests/artifacts/certify-html/`` (ignored by git); the test prints where.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from controller import certify_report
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
    reports = certify_report.write_reports(tmp_path / "reports", full_report())
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

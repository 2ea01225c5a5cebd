"""``controller certify``: the acceptance checks of a provisioned box, and the buyer's report."""

from __future__ import annotations

import json
from pathlib import Path

import click

from controller.cli.options import box_command, inventory_for, load


@box_command
@click.option("--burn-in", "burn_in", default=None, metavar="DURATION",
              help="Also run concurrent load for this long while sampling the GPUs: 25m, 1h30m, 90s.")
def certify(box: str, fleet_path: Path, inventory: Path | None, as_json: bool, burn_in: str | None) -> None:
    """Certify BOX: identity, what is installed, both APIs with a tool call and streaming, throughput against
    its band, the thermal guard and power limits (and a burn-in); writes the report in Markdown, JSON and HTML.

    Exits 0 only when every check passed (6 when one failed)."""
    from controller.actions.certify import CertificationFailed, parse_duration
    from controller.actions.certify import certify as certify_box
    from controller.cli.progress import Progress

    seconds = parse_duration(burn_in) if burn_in is not None else 0.0  # before any connection
    fleet = load(fleet_path)
    report = certify_box(fleet, fleet_path, box, inventory_for(fleet_path, inventory), burn_in_s=seconds,
                         on_event=None if as_json else Progress())
    if as_json:
        click.echo(json.dumps({"box": report["box"], "passed": report["passed"],
                               "checks": [{key: item[key] for key in ("name", "passed", "detail")}
                                          for item in report["checks"]],
                               "not_checked": report["not_checked"], "reports": report["reports"]}))
    else:
        click.echo(f"{report['box']}: certification {'PASSED' if report['passed'] else 'FAILED'}")
        for item in report["checks"]:
            click.echo(f"  {'pass' if item['passed'] else 'FAIL'}  {item['name']}: {item['detail']}")
        for item in report["not_checked"]:
            click.echo(f"  ----  {item['name']}: not checked: {item['why']}")
        click.echo("reports: " + ", ".join(str(path) for path in report["reports"].values() if path))
    if not report["passed"]:
        failed = [item["name"] for item in report["checks"] if not item["passed"]]
        raise CertificationFailed(f"box {report['box']} failed {len(failed)} check(s): {', '.join(failed)}; "
                                  f"the report says why: {report['reports']['markdown']}")

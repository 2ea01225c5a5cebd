"""Verification, in one place: run the checks on a box, decide whether it is verified, say so in the report.

``run_verify`` runs playbooks/verify.yml on a rendered box (the ``verify`` command); provision's site.yml
runs the same role last. ``results`` reads what the checks answered from a run, ``verdict`` decides from
those answers and the plan, ``report_fields`` is what a report says of each service.
"""

from controller.errors import NotRendered
from controller.stages.verify.run import PLAYBOOK, run_verify
from controller.stages.verify.verdict import (
    STATS_KEY,
    ServiceVerdict,
    Verdict,
    check_service,
    expects_key,
    report_fields,
    results,
    verdict,
)

__all__ = ["PLAYBOOK", "STATS_KEY", "NotRendered", "ServiceVerdict", "Verdict", "check_service", "expects_key",
           "report_fields", "results", "run_verify", "verdict"]

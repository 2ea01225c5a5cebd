"""The serving planner: which llama-server runs where on a box, with which arguments, and why.

``plan_box`` (a fleet box) and ``plan_models`` (a bare profile) return a ``ServePlan``; see
``controller.planner.core`` for the decision rules and ``controller.planner.specs`` for how a
model's memory is known before it is downloaded.
"""

from controller.planner.core import plan_box, plan_models, service_name

__all__ = ["plan_box", "plan_models", "service_name"]

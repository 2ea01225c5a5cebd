"""The serving planner: which llama-server runs where on a box, with which arguments, and why.

``plan_box`` (a fleet box) and ``plan_models`` (a bare profile) return a complete ``ServePlan``:
``placement`` decides the cards, engine and context, ``commandline`` spells them for the pinned
engine version, ``sources`` resolves what the box fetches, ``specs`` knows a model's memory before
it is downloaded, and ``core`` puts one service together from them.
"""

from controller.stages.planner.core import plan_box, plan_models, service_name
from controller.stages.planner.sources import plan_driver

__all__ = ["plan_box", "plan_driver", "plan_models", "service_name"]

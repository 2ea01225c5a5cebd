"""Registers the project's Jinja filters; the functions live in controller.ansible_filters.

Filters run on the control node (the controller, an AWX execution environment, or a box running ansible-pull
on itself), never through a module on the target. A checkout that is not installed (an AWX project, an
ansible-pull clone) finds ``controller`` two folders up from this file; it needs PyYAML, pydantic and json5.
"""

import sys
from pathlib import Path

try:
    from controller.ansible_filters import filters
except ImportError:
    sys.path.append(str(Path(__file__).resolve().parents[2]))
    from controller.ansible_filters import filters


class FilterModule:
    def filters(self):
        return filters()

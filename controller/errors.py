"""One base exception; each subclass is a kind of problem an operator can fix.

Messages say what is wrong and what to change, in one line where possible: the CLI prints them
without a traceback.
"""


class ControllerError(Exception):
    """Base class of every error the controller reports to the operator."""

    exit_code = 1


class FleetError(ControllerError):
    """The fleet file is missing, malformed, or names something that does not exist."""

    exit_code = 2


class CatalogError(ControllerError):
    """A model or engine catalog is malformed, or an id is not in it."""

    exit_code = 2


class TransportError(ControllerError):
    """A box could not be reached or would not accept the credentials."""

    exit_code = 3


class ProbeError(ControllerError):
    """Probe output could not be turned into a usable hardware profile."""

    exit_code = 2


class PlanError(ControllerError):
    """No serving configuration fits what was asked."""

    exit_code = 4


class RunError(ControllerError):
    """A playbook run failed; the message names the failed tasks."""

    exit_code = 5


class VerifyError(ControllerError):
    """The served endpoints did not answer as the plan says they should."""

    exit_code = 6

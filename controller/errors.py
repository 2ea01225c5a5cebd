"""One base exception; each subclass is a kind of problem an operator can fix.

Messages say what is wrong and what to change, in one line where possible: the CLI prints them
without a traceback.
"""


class ControllerError(Exception):
    """Base class of every error the controller reports to the operator; each kind names its exit code."""

    exit_code = 1

    def __init_subclass__(cls, exit_code: int | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if exit_code is not None:
            cls.exit_code = exit_code


class NotRendered(ControllerError, exit_code=1):
    """The inventory lacks what an earlier command writes there for the box (its plan, its rendered host_vars, its
    provisioning report), or holds a copy this controller cannot read: the line names the command that makes it."""


class FleetError(ControllerError, exit_code=2):
    """The fleet file is missing, malformed, or names something that does not exist."""


class CatalogError(ControllerError, exit_code=2):
    """A model or engine catalog is malformed, or an id is not in it."""


class TransportError(ControllerError, exit_code=3):
    """A box could not be reached or would not accept the credentials."""


class ProbeError(ControllerError, exit_code=2):
    """Probe output could not be turned into a usable hardware profile."""


class PlanError(ControllerError, exit_code=4):
    """No serving configuration fits what was asked."""


class RunError(ControllerError, exit_code=5):
    """A playbook run failed; the message names the failed tasks."""


class VerifyError(ControllerError, exit_code=6):
    """The served endpoints did not answer as the plan says they should."""


class SetupError(ControllerError, exit_code=2):
    """This installation lacks something the command needs (``controller demo`` needs a clone's lab/)."""


class DraftError(ControllerError, exit_code=2):
    """A draft model its target cannot use at all: larger than the target, or on an engine without draft flags."""


class LockError(ControllerError, exit_code=7):
    """The fleet's lock does not match: another fleet's lock, a box it names that the fleet lacks, or a box whose
    fresh plan, catalog checksums or engines differ from what the lock says (``controller lock --update``)."""


class FleetRunError(ControllerError, exit_code=8):
    """A run over several boxes finished, and some of them failed or were unreachable (the summary names them)."""


class SealRefused(ControllerError, exit_code=10):
    """``controller seal`` will not seal this box: it has no passed certification (the line says what to run), or
    it is one seal cannot hand over yet (a Windows box, a box running a gateway)."""

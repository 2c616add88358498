"""The environment Flower runs under here: no telemetry, no update check, no runtime installs.

Flower reads some of these when it is imported, so the package's ``__init__`` calls :func:`apply`
before any module of the package imports flwr; subprocesses (the deployment's SuperLink and SuperNodes, test runs) get
:data:`FLWR_ENV` in their environment. This module imports nothing from Flower.

:class:`FlowerNoticeFilter` drops named notices of Flower's ``flwr`` logger that say nothing a
person can act on (see ``fedsim.simulation``); every other Flower line, warnings and errors
included, goes through.
"""

from __future__ import annotations

import logging
import os

FLWR_ENV: dict[str, str] = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}


# A Flower notice: the start of its message template (``record.msg``, before %-formatting) and,
# when the template takes arguments, the start of the first one.
Notice = tuple[str, str]

# flwr.simulation.run_simulation warns about itself on every call (flwr 1.42: via
# flwr.supercore.logger.warn_deprecated_feature, a WARNING record of the "flwr" logger).
RUN_SIMULATION_DEPRECATED: Notice = ("DEPRECATED FEATURE: %s", "The `run_simulation` function is deprecated")
# Each Ray actor of the simulation engine logs this WARNING when the engine ends it: at the end of
# every run, or when the actor no longer fits a shrunken Ray cluster (a multi-node case that local
# simulation does not meet); flwr.simulation.ray_transport.ray_actor.
ACTOR_TERMINATED: Notice = ("Manually terminating %s", "ClientAppActor")
# The strategy's notice when clients do not evaluate: the run config's fraction-evaluate 0 (its
# default) means the server evaluates centrally, which it reports itself.
NO_FEDERATED_EVALUATION: Notice = ("fraction_evaluate is set to 0.0. Federated evaluation will be skipped.", "")


class FlowerNoticeFilter(logging.Filter):
    """A filter for the ``flwr`` logger that drops the records of the given notices, and only them."""

    def __init__(self, *notices: Notice) -> None:
        super().__init__()
        self.notices = notices

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(_is_notice(record, notice) for notice in self.notices)


def _is_notice(record: logging.LogRecord, notice: Notice) -> bool:
    template, first_arg = notice
    if record.name != "flwr" or not isinstance(record.msg, str) or not record.msg.startswith(template):
        return False
    if not first_arg:
        return True
    args = record.args if isinstance(record.args, tuple) else ()
    return bool(args) and str(args[0]).startswith(first_arg)


# Installed by apply(), so also in the simulation's Ray actors, which log ACTOR_TERMINATED in their own
# processes: they import fedsim.client_app (it calls apply()) to run their first client.
_ACTOR_FILTER = FlowerNoticeFilter(ACTOR_TERMINATED)


def apply() -> None:
    """Set :data:`FLWR_ENV` in this process, leaving any value the user set, and drop Flower's
    actor-shutdown notice (:data:`ACTOR_TERMINATED`) from its log."""
    for key, value in FLWR_ENV.items():
        os.environ.setdefault(key, value)
    flwr_logger = logging.getLogger("flwr")  # the logger flwr will use; creating it imports nothing
    if _ACTOR_FILTER not in flwr_logger.filters:
        flwr_logger.addFilter(_ACTOR_FILTER)

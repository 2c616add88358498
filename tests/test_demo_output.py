"""What Flower prints around ``run_simulation_job``: its deprecation of run_simulation is dropped,
its other warnings and errors are not; ``quiet`` (the main job) drops its INFO lines too.

No Ray run: the real ``flwr.simulation.run_simulation`` runs (it emits the deprecation the way it does
in every demo), with the engine behind it (``_run_simulation``) replaced by a stand-in that logs
through Flower's own logger functions and writes the run's results file."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import flwr.simulation  # noqa: F401  (loads flwr.simulation.run_simulation, the module)
import pytest
from flwr.supercore.logger import log, warn_deprecated_feature

from fedsim import flower_env

OTHER_WARNING = "Some other Flower warning %s"


class _Records(logging.Handler):
    """The records that reach the flwr logger's handlers, i.e. what Flower's console handler prints."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        return "\n".join(r.getMessage() for r in self.records)


@pytest.fixture
def flwr_records():
    handler = _Records()
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Replace the simulation engine: log like a run does, then write results.json."""
    run_dir = tmp_path / "run"

    def fake_run_simulation(**_: Any) -> None:
        log(logging.INFO, "[ROUND 1/1]")
        log(logging.WARNING, "fraction_evaluate is set to 0.0. Federated evaluation will be skipped.")
        log(logging.WARNING, OTHER_WARNING, "(kept)")
        warn_deprecated_feature("Some other deprecated feature.")
        log(logging.ERROR, "ClientApp raised an exception")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "results.json").write_text(json.dumps({}))

    monkeypatch.setattr(sys.modules["flwr.simulation.run_simulation"], "_run_simulation", fake_run_simulation)
    monkeypatch.delenv("FLWR_LOG_LEVEL", raising=False)
    return {
        "num-clients": 2,
        "num-server-rounds": 1,
        "download": False,
        "data-root": str(tmp_path / "data"),
        "run-dir": str(run_dir),
    }


def test_flowers_deprecation_of_run_simulation_is_dropped_and_nothing_else(engine, flwr_records) -> None:
    from fedsim.simulation import run_simulation_job

    logger = logging.getLogger("flwr")
    filters, level = list(logger.filters), logger.level
    run_simulation_job(engine)
    text = flwr_records.text()
    assert "run_simulation` function is deprecated" not in text
    assert "This is a deprecated feature" in text  # the other deprecated feature's block
    assert "Some other deprecated feature." in text
    assert "Some other Flower warning (kept)" in text
    assert "fraction_evaluate is set to 0.0" in text  # dropped by quiet only
    assert "ClientApp raised an exception" in text
    assert "[ROUND 1/1]" in text  # Flower's INFO lines as before
    assert logger.filters == filters and logger.level == level  # the filter is on during the call only


def test_quiet_leaves_flowers_warnings_and_errors_only(engine, flwr_records) -> None:
    from fedsim.simulation import run_simulation_job

    level = logging.getLogger("flwr").level
    run_simulation_job(engine, quiet=True)
    text = flwr_records.text()
    assert "[ROUND 1/1]" not in text
    assert "run_simulation` function is deprecated" not in text
    assert "fraction_evaluate is set to 0.0" not in text
    assert "Some other Flower warning (kept)" in text
    assert "Some other deprecated feature." in text
    assert "ClientApp raised an exception" in text
    assert logging.getLogger("flwr").level == level


def test_quiet_yields_to_verbose_and_flwr_log_level(engine, flwr_records, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedsim.simulation import run_simulation_job

    monkeypatch.setenv("FLWR_LOG_LEVEL", "INFO")
    run_simulation_job(engine, quiet=True)
    assert "[ROUND 1/1]" in flwr_records.text()
    assert "run_simulation` function is deprecated" not in flwr_records.text()


def test_the_actors_shutdown_notice_is_dropped_in_every_process_that_applies_the_env(flwr_records) -> None:
    flower_env.apply()  # what importing fedsim does in each Ray actor
    flower_env.apply()  # idempotent: one filter
    logger = logging.getLogger("flwr")
    assert sum(isinstance(f, flower_env.FlowerNoticeFilter) for f in logger.filters) == 1
    log(logging.WARNING, "Manually terminating %s", "ClientAppActor")
    log(logging.WARNING, "Manually terminating %s", "SomethingElse")
    log(logging.WARNING, OTHER_WARNING, "(kept)")
    assert flwr_records.text().splitlines() == [
        "Manually terminating SomethingElse",
        "Some other Flower warning (kept)",
    ]

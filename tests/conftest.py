"""Shared pytest options: ``--run-slow`` runs the long fuzz and soak budgets (marker ``slow``).
The fixture ``session_index_cache`` points refstream's index cache at one folder for the session,
so modules that make many datasets of the same files index each file once.

Hypothesis runs without its timing checks (a per-example deadline, a "data generation is too
slow" health check): on a loaded machine they fail correct code, and no test here is about speed.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("refstream", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("refstream")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="run the long fuzz and soak budgets (tests marked slow)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="long run: pass --run-slow")
    for item in items:
        if item.get_closest_marker("slow") is not None:  # not item.keywords: ids say "slow" too
            item.add_marker(skip)


@pytest.fixture
def session_index_cache(tmp_path_factory: pytest.TempPathFactory,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFSTREAM_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))

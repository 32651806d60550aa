"""The conformance runner: every golden fixture passes through refstream's own adapter (in
process and through the stdin/stdout protocol), and a deliberately broken adapter fails every
case with a first-difference message."""

import subprocess
import sys
from pathlib import Path

import pytest

from refstream.tools import conformance

CASES = conformance.load_cases()
TESTS_DIR = Path(__file__).resolve().parent


def test_the_suite_is_not_empty_and_every_kind_has_an_adapter():
    assert len(CASES) >= 40
    assert {case.kind for case in CASES} <= set(conformance.ADAPTERS)


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: str(c.path.relative_to(conformance.FIXTURES_DIR))
)
def test_refstream_passes_every_fixture(case):
    assert conformance.first_difference(case.expected, conformance.in_process(case)) is None


def test_the_protocol_command_gives_the_same_answers():
    # One case per kind through a real subprocess: proves the stdin/stdout protocol end to end.
    one_per_kind = {case.kind: case for case in CASES}.values()
    ask = conformance.via_command(f"{sys.executable} -m refstream.tools.conformance")
    for outcome in conformance.run(list(one_per_kind), ask):
        assert outcome.difference is None, (outcome.case.path, outcome.difference)


def test_a_broken_implementation_fails_with_the_first_difference():
    command = f"{sys.executable} {TESTS_DIR / 'broken_adapter.py'}"
    one_per_kind = list({case.kind: case for case in CASES}.values())
    outcomes = list(conformance.run(one_per_kind, conformance.via_command(command)))
    assert all(o.difference is not None for o in outcomes)
    assert any("expected" in o.difference and "got" in o.difference for o in outcomes)


def test_the_cli_prints_failures_and_the_summary_line():
    command = f"{sys.executable} {TESTS_DIR / 'broken_adapter.py'}"
    kind = CASES[0].kind
    done = subprocess.run(
        [sys.executable, "-m", "refstream", "conformance", "--impl", command, "--kind", kind],
        capture_output=True,
        text=True,
        timeout=600,
    )
    n = sum(1 for case in CASES if case.kind == kind)
    assert done.returncode == 1
    assert done.stdout.count("FAIL ") == n
    assert done.stdout.strip().endswith(f"0 passed, {n} failed")


def test_first_difference_names_the_path():
    expected = {"anchors": [[0, 1], [2, 3]], "n": 2}
    assert conformance.first_difference(expected, expected) is None
    assert conformance.first_difference(expected, {"anchors": [[0, 1], [2, 4]], "n": 2}) == (
        ".anchors[1][1]: expected 3, got 4"
    )
    assert conformance.first_difference({"a": True}, {"a": 1}) == ".a: expected true, got 1"
    assert "missing" in conformance.first_difference({"a": 1}, {})

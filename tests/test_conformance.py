"""The conformance runner and the suite itself: every golden fixture passes through refstream's
own adapter (in process and through the stdin/stdout protocol); spec/run.py runs in a virtual
environment with nothing installed; a deliberately broken implementation fails every case; every
case survives a JavaScript-style JSON parser (the encoding of spec/README.md); every reference
video has its expected table; the runner says clearly where the fixtures are when they are
missing."""

import dataclasses
import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import wrong_adapter
from broken_adapter import corrupt

from refstream import errors
from refstream.errors import UsageError
from refstream.tools import conformance

CASES = conformance.load_cases()
TESTS_DIR = Path(__file__).resolve().parent
FIXTURES = conformance.FIXTURES_DIR
RUN_PY = FIXTURES.parent / "run.py"
ADAPTER = f"{sys.executable} -m refstream.tools.conformance"
EXACT_JSON_INTEGERS = 2**53  # a binary64 holds every integer of smaller magnitude exactly


def case_id(case):
    return str(case.path.relative_to(FIXTURES))


def test_the_suite_is_large_and_every_kind_has_an_adapter():
    assert len(CASES) >= 240
    assert {case.kind for case in CASES} == set(conformance.ADAPTERS)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_refstream_passes_every_fixture(case):
    assert conformance.first_difference(case.expected, conformance.in_process(case)) is None


def test_a_broken_implementation_fails_every_case():
    # The broken adapter answers like refstream, then changes the first number (or drops an
    # expected error): a near miss, which the runner must report for every single case.
    passing = [case_id(c) for c in CASES
               if conformance.first_difference(c.expected, broken_answer(c)) is None]
    assert passing == []


def broken_answer(case):
    reply = conformance.in_process(case)
    return {} if "error" in reply else corrupt(reply)[0]


def test_the_protocol_command_gives_the_same_answers():
    # One case per kind through a real subprocess: proves the stdin/stdout protocol end to end.
    one_per_kind = {case.kind: case for case in CASES}.values()
    command = conformance.load_runner().via_command(ADAPTER, FIXTURES)
    replies = {}

    def ask(case):
        replies[case.path] = command(case)
        return replies[case.path]

    for outcome in conformance.load_runner().run(list(one_per_kind), ask):
        # a failed process answers {"error": ...}: show it, not only the first missing field
        assert outcome.difference is None, (outcome.case.path, outcome.difference,
                                            replies[outcome.case.path].get("error"))


def test_a_broken_command_fails_with_the_first_difference():
    command = f"{sys.executable} {TESTS_DIR / 'broken_adapter.py'}"
    one_per_kind = list({case.kind: case for case in CASES}.values())
    runner = conformance.load_runner()
    outcomes = list(runner.run(one_per_kind, runner.via_command(command, FIXTURES)))
    assert all(o.difference is not None for o in outcomes)
    assert any("expected" in o.difference and "got" in o.difference for o in outcomes)


def test_the_cli_prints_failures_and_the_summary_line():
    command = f"{sys.executable} {TESTS_DIR / 'broken_adapter.py'}"
    kind = "budget_ops"
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


def test_the_runner_runs_with_nothing_but_python(tmp_path):
    # spec/run.py, copied alone with the fixtures, run by a virtual environment's python with
    # nothing installed (-I: not even PYTHONPATH), asks refstream's adapter one case per kind.
    copy = tmp_path / "spec"
    shutil.copytree(FIXTURES, copy / "fixtures")
    shutil.copy(RUN_PY, copy / "run.py")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", tmp_path / "venv"], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    assert subprocess.run([python, "-I", "-c", "import numpy"], capture_output=True).returncode
    one_per_kind = {case.kind: case_id(case) for case in CASES}
    selection = [f"--case={name}" for name in one_per_kind.values()]

    def runner(impl: str) -> subprocess.CompletedProcess:
        return subprocess.run([python, "-I", copy / "run.py", "--impl", impl, "--jobs", "2",
                               *selection], capture_output=True, text=True, timeout=600)

    done = runner(ADAPTER)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{len(one_per_kind)} passed, 0 "
                                                                 "failed\n", "")
    done = runner(f"{sys.executable} {TESTS_DIR / 'broken_adapter.py'}")
    lines = done.stdout.splitlines()
    assert done.returncode == 1
    assert lines[-1] == f"0 passed, {len(one_per_kind)} failed"
    assert sorted(line.split()[1] for line in lines[:-1]) == sorted(one_per_kind.values())


def test_the_runner_selects_cases_by_kind_and_name():
    runner = conformance.load_runner()
    assert {c.kind for c in runner.load_cases(FIXTURES, ["rng", "plan"])} == {"rng", "plan"}
    named = runner.load_cases(FIXTURES, [], ["rng/null-seed-is-42", "meta/valid-*.json"])
    assert [c.name for c in named][-1] == "rng/null-seed-is-42"
    assert {c.name.split("/")[0] for c in named} == {"meta", "rng"}
    assert len(named) == 1 + sum(c.name.startswith("meta/valid-") for c in CASES)
    assert runner.main(["--impl", "true", "--kind", "no-such-kind"]) == 2  # selects no case


def test_the_runner_reports_a_command_that_gives_no_answer(tmp_path):
    runner = conformance.load_runner()
    case = CASES[0]
    script = tmp_path / "impl.py"
    for body, said in [("import sys; sys.exit(3)", "no answer: exit status 3"),
                       ("print('[1, 2]')", "no answer: not a JSON object"),
                       ("print('{\"a\": NaN}')", "no answer: not one JSON object")]:
        script.write_text(body)
        outcome = runner.judge(case, runner.via_command(f"{sys.executable} {script}", FIXTURES))
        assert outcome.difference.startswith(said)


@pytest.mark.parametrize("point", sorted(wrong_adapter.WRONG))
def test_each_settled_point_fails_under_a_wrong_choice(point, monkeypatch):
    # The cases that pin a point pass with refstream's adapter and fail, every one, with the
    # adapter that answers that one point another way.
    names, patch = wrong_adapter.WRONG[point]
    runner = conformance.load_runner()
    cases = runner.load_cases(FIXTURES, [], names)
    assert len(cases) == len(names)
    assert [o.difference for o in runner.run(cases, conformance.in_process)] == [None] * len(names)
    patch(monkeypatch)
    assert all(o.difference for o in runner.run(cases, conformance.in_process))


def test_first_difference_names_the_path():
    expected = {"anchors": [[0, 1], [2, 3]], "n": 2}
    assert conformance.first_difference(expected, expected) is None
    assert conformance.first_difference(expected, {"anchors": [[0, 1], [2, 4]], "n": 2}) == (
        ".anchors[1][1]: expected 3, got 4"
    )
    assert conformance.first_difference({"a": True}, {"a": 1}) == ".a: expected true, got 1"
    assert conformance.first_difference({"a": 7.0}, {"a": 7}) is None
    assert "missing" in conformance.first_difference({"a": 1}, {})
    assert "unexpected key" in conformance.first_difference({}, {"a": 1})
    assert conformance.first_difference({"error": "ShardingError"}, {"error": "UsageError"})


# --- the encoding ----------------------------------------------------------------------------


def javascript_number(text: str):
    """A JSON number as JavaScript's JSON.parse holds it (one binary64), handed to Python as an
    int when it is integral, as JavaScript's Number.isInteger would say: 1 and 1.0 alike."""
    value = float(text)
    return int(value) if value.is_integer() else value


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_case_survives_a_javascript_json_parser(case):
    text = json.dumps({"input": case.input, "expected": case.expected})
    seen = json.loads(text, parse_int=javascript_number, parse_float=javascript_number)
    ask = dataclasses.replace(case, input=seen["input"], expected=seen["expected"])
    assert conformance.first_difference(case.expected, conformance.in_process(ask)) is None


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_integers_a_double_cannot_hold_travel_as_strings(case):
    def numbers(value):
        if isinstance(value, dict):
            for item in value.values():
                yield from numbers(item)
        elif isinstance(value, list):
            for item in value:
                yield from numbers(item)
        elif isinstance(value, int) and not isinstance(value, bool):
            yield value

    found = [*numbers(case.input), *numbers(case.expected)]
    assert all(abs(v) < EXACT_JSON_INTEGERS for v in found)


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")
def test_the_javascript_example_passes_every_rng_case():
    # spec/example/rng.mjs, written from SPEC alone, reads every case with JSON.parse.
    rng_cases = [case for case in CASES if case.kind == "rng"]
    runner = conformance.load_runner()
    ask = runner.via_command("node ../example/rng.mjs", FIXTURES)
    assert [o.difference for o in runner.run(rng_cases, ask)] == [None] * len(rng_cases)


# --- the fixtures themselves -------------------------------------------------------------------


def error_table() -> dict[str, tuple[str, set[str]]]:
    """SPEC §12 as ``name -> (parent, kinds that may answer it)``."""
    text = (FIXTURES.parent / "SPEC.md").read_text(encoding="utf-8")
    section = text[text.index("## 12. Errors"):]
    rows = re.findall(r"^\| `(\w+)` \| (?:`(\w+)`|—) \| .* \| (.*) \|$", section, re.MULTILINE)
    return {name: (parent, set(re.findall(r"`(\w+)`", kinds))) for name, parent, kinds in rows}


def test_the_error_table_is_refstreams_errors_and_the_fixtures_answers():
    table = error_table()
    classes = {name: cls for name, cls in inspect.getmembers(errors, inspect.isclass)
               if issubclass(cls, errors.RefstreamError)}
    assert set(table) == set(classes)
    for name, (parent, _) in table.items():
        bases = [b.__name__ for b in classes[name].__bases__ if b.__name__ in classes]
        assert bases == ([parent] if parent else []), name
    answered = {(c.expected["error"], c.kind) for c in CASES if "error" in c.expected}
    answered |= {(r["error"], c.kind) for c in CASES if c.kind == "budget_ops"
                 for r in c.expected["results"] if isinstance(r, dict)}
    assert {(error, kind) for error, kind in answered if kind not in table[error][1]} == set()



def test_every_reference_video_has_its_expected_table():
    tables = {case.input["file"] for case in CASES if case.kind == "mp4_index"}
    videos = {str(path.relative_to(FIXTURES)) for path in FIXTURES.rglob("*.mp4")}
    assert videos - tables == set()


def test_the_runner_says_where_the_fixtures_are_when_they_are_missing(tmp_path):
    with pytest.raises(UsageError, match="--fixtures"):
        conformance.fixtures_folder(tmp_path / "nowhere")
    with pytest.raises(UsageError, match="not installed with the package"):
        conformance.fixtures_folder(tmp_path)  # a folder without cases
    assert conformance.fixtures_folder(FIXTURES) == FIXTURES
    done = subprocess.run(
        [sys.executable, "-m", "refstream", "conformance", "--fixtures", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 2
    assert "--fixtures PATH/TO/spec/fixtures" in done.stderr


def test_a_copied_fixtures_folder_runs_from_anywhere(tmp_path):
    # An installed refstream runs a copy of spec/ wherever it lies, media included.
    copy = tmp_path / "spec" / "fixtures"
    shutil.copytree(FIXTURES / "mp4", copy / "mp4")
    shutil.copytree(FIXTURES / "synth", copy / "synth")
    with pytest.raises(UsageError, match="spec/run.py"):
        conformance.load_runner(copy)  # a fixtures folder without its runner
    shutil.copy(RUN_PY, copy.parent / "run.py")
    cases = conformance.load_cases(conformance.fixtures_folder(copy))
    assert cases and all(c.root == copy for c in cases)
    outcomes = conformance.load_runner(copy).run(cases, conformance.in_process)
    assert [o.difference for o in outcomes] == [None] * len(cases)

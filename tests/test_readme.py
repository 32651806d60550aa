"""What the README promises that code can check: it starts with the two commands a fresh machine
runs (a virtual environment, torch, refstream and the demo; then the test suite), and the
figures it explains (the demo's bytes, the HTTP whole-body cap) are the code's own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from refstream.http import WHOLE_BODY_CAP_BYTES
from refstream.tools.demo import DEMO_BUDGET_FRACTION, run_demo

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
PROSE = " ".join(README.split())


def first_commands() -> list[str]:
    """The commands of the README's first code block: continuations joined, comments dropped."""
    block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert block is not None and block.start() < README.index("\n## "), "no commands on top"
    lines = block.group(1).replace("\\\n", " ").splitlines()
    return [" ".join(line.split()) for line in lines if line.strip() and
            not line.lstrip().startswith("#")]


def test_the_readme_starts_with_two_commands_for_a_fresh_machine():
    first, second = first_commands()
    steps = first.split(" && ")
    venv = re.fullmatch(r"python3 -m venv (?:--[\w-]+ )*(\S+)", steps[0])
    assert venv is not None, steps[0]  # pip into a venv: Debian's python3 refuses it (PEP 668)
    assert steps[1] == f". {venv.group(1)}/bin/activate"
    assert steps[2:] == ["pip install torch==2.13.0", "pip install -e .", "refstream demo"]
    assert second == "bash .ci/run"
    assert "python3 -m pip install -q torch==2.13.0" in (REPO / ".ci" / "run").read_text()


def test_http_roots_need_range_support_and_the_cap_is_the_codes():
    assert "server must support range requests" in PROSE
    assert WHOLE_BODY_CAP_BYTES == 1 << 20 and "accepted only for files up to 1 MiB" in PROSE


def test_the_demo_figures_the_readme_explains_are_the_demos(tmp_path, monkeypatch):
    monkeypatch.setenv("REFSTREAM_CACHE", str(tmp_path / "cache"))
    report = run_demo(progress=False)
    assert not report.problems
    assert DEMO_BUDGET_FRACTION == 0.5 and "byte budget to half the dataset's video bytes" in PROSE
    ratio = report.body_bytes / report.dataset_bytes
    assert f"{ratio:.2f} x the dataset" in report.lines()[-1]
    assert f"{ratio:.2f} × the dataset's size" in PROSE
    assert report.video_span_requests == report.episodes * report.cameras  # each span once
    assert (f"{report.video_span_requests} span requests for {report.episodes} episodes × "
            f"{report.cameras} cameras") in PROSE


def definition_line(path: Path, name: str) -> int | None:
    """The line where ``name`` (``Class.method`` or a top-level name) is defined in ``path``."""
    body, node = ast.parse(path.read_text()).body, None
    for part in name.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return node.lineno


def reading_references(readme: str) -> list[tuple[str, int, str]]:
    """``(module, line, name)`` of each ``module.py:LINE name`` in "Reading the code"."""
    section = readme.split("\n## Reading the code\n", 1)[1].split("\n## ", 1)[0]
    return [(module, int(line), name) for module, line, name
            in re.findall(r"`(\w+)\.py:(\d+)\s+([\w.]+)`", section)]


def misplaced(readme: str) -> list[str]:
    """The references of "Reading the code" whose name is not defined at their line."""
    wrong = []
    for module, line, name in reading_references(readme):
        found = definition_line(REPO / "refstream" / f"{module}.py", name)
        if found != line:
            wrong.append(f"{module}.py:{line} {name} is at line {found}")
    return wrong


def test_the_reading_path_points_at_each_definition():
    assert len(reading_references(README)) >= 20
    assert misplaced(README) == [], "the README's reading path moved: update its line numbers"


def test_a_moved_definition_is_caught():
    module, line, name = reading_references(README)[0]
    moved = README.replace(f"`{module}.py:{line}", f"`{module}.py:{line + 1}", 1)
    assert misplaced(moved) == [f"{module}.py:{line + 1} {name} is at line {line}"]
    missing = README.replace(f"{line} {name}`", f"{line} {name}_gone`", 1)
    assert misplaced(missing) == [f"{module}.py:{line} {name}_gone is at line None"]

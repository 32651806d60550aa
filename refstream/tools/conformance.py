"""Run the golden fixtures in ``spec/fixtures`` against an implementation.

The protocol (an implementation is a command run once per case), the encoding and the case
format are in ``spec/README.md``, the kinds in ``spec/SPEC.md``; an answer passes when it equals
the case's ``expected`` (:func:`first_difference`).

refstream's own adapter (``python -m refstream.tools.conformance``) is the default; with no
``--impl`` the runner calls the same adapters in-process (:func:`in_process`), through the same
JSON round trip. The fixtures are not part of the installed package: an installed refstream
needs ``--fixtures`` (:func:`fixtures_folder` says so).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from refstream.errors import UsageError
from refstream.tools.adapters import ADAPTERS, FIXTURES_DIR, answer

__all__ = ["ADAPTERS", "FIXTURES_DIR", "answer", "fixtures_folder", "load_cases", "run",
           "via_command", "in_process"]

# A case that makes an implementation run longer than this fails instead of hanging the runner.
CASE_TIMEOUT_S = 120


@dataclass(frozen=True)
class Case:
    path: Path
    kind: str
    input: dict
    expected: dict
    root: Path  # the fixtures folder: media paths in ``input`` are relative to it


@dataclass(frozen=True)
class Outcome:
    case: Case
    difference: str | None  # None when the answer equals the expectation


def fixtures_folder(path: str | Path | None = None) -> Path:
    """The fixtures folder to run: ``path``, else the source checkout's ``spec/fixtures``.
    :class:`UsageError` when it holds no case, saying where the fixtures come from."""
    root = Path(path) if path is not None else FIXTURES_DIR
    if not root.is_dir() or not any(root.rglob("*.json")):
        where = f"--fixtures {path}" if path is not None else f"the default {root}"
        raise UsageError(f"no conformance cases in {where}: the fixtures are the spec/fixtures "
                         "folder of refstream's source (they are not installed with the "
                         "package); pass --fixtures PATH/TO/spec/fixtures")
    return root


def load_cases(root: Path = FIXTURES_DIR, kind: str | None = None) -> list[Case]:
    """Every case under ``root`` (sorted by path), optionally only those of one kind."""
    cases = []
    for path in sorted(root.rglob("*.json")):
        document = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(document, dict) or "kind" not in document:
            continue  # descriptions of media files and other JSON live beside the cases
        if kind is None or document["kind"] == kind:
            cases.append(Case(path, document["kind"], document["input"], document["expected"],
                              root))
    return cases


def first_difference(expected, actual, where: str = "") -> str | None:
    """A description of the first place where two JSON values differ, or None if equal."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in sorted(set(expected) | set(actual)):
            if key not in actual:
                return f"{where}.{key}: missing"
            if key not in expected:
                return f"{where}.{key}: unexpected key"
            found = first_difference(expected[key], actual[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(expected, list) and isinstance(actual, list):
        for i, (e, a) in enumerate(zip(expected, actual, strict=False)):
            found = first_difference(e, a, f"{where}[{i}]")
            if found:
                return found
        if len(expected) != len(actual):
            return f"{where}: expected {len(expected)} items, got {len(actual)}"
        return None
    same_type = isinstance(expected, bool) == isinstance(actual, bool)
    if same_type and expected == actual:
        return None
    return f"{where or '.'}: expected {_short(expected)}, got {_short(actual)}"


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def in_process(case: Case) -> dict:
    """Ask refstream's own adapter, through the same JSON round trip as the protocol."""
    reply = answer(case.kind, json.loads(json.dumps(case.input)), case.root)
    return json.loads(json.dumps(reply))


def via_command(command: str, fixtures: Path = FIXTURES_DIR) -> Callable[[Case], dict]:
    """Ask an implementation command, one process per case, run inside ``fixtures``."""
    argv = shlex.split(command)

    def ask(case: Case) -> dict:
        request = json.dumps({"kind": case.kind, "input": case.input}, ensure_ascii=False)
        try:
            done = subprocess.run(argv, input=request, capture_output=True, encoding="utf-8",
                                  timeout=CASE_TIMEOUT_S, cwd=fixtures)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {CASE_TIMEOUT_S} s"}
        if done.returncode != 0:
            return {"error": f"exit status {done.returncode}: {done.stderr.strip()[-200:]}"}
        try:
            return json.loads(done.stdout)
        except json.JSONDecodeError:
            return {"error": f"not JSON: {_short(done.stdout)}"}

    return ask


def run(cases: list[Case], ask: Callable[[Case], dict]) -> Iterator[Outcome]:
    for case in cases:
        yield Outcome(case, first_difference(case.expected, ask(case)))


def main_adapter() -> int:
    """The protocol end of refstream's adapter: one case on stdin, one answer on stdout; run
    inside the fixtures folder."""
    request = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    reply = json.dumps(answer(request["kind"], request["input"], Path.cwd()))
    sys.stdout.buffer.write(reply.encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main_adapter())

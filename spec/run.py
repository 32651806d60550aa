#!/usr/bin/env python3
"""Run the conformance cases in ``fixtures/`` against an implementation command.

Standard library only (Python 3.10 or later), so it runs from a copy of this ``spec/`` folder
with nothing installed::

    python3 spec/run.py --impl "./my-implementation"             # every case
    python3 spec/run.py --impl "node ../example/rng.mjs" --kind rng
    python3 spec/run.py --impl CMD --case plan/pool-budget-skip --case 'meta/valid-*'

The protocol (one process per case, run inside the fixtures folder, one JSON object in and one
out) and the comparison of answers are in ``README.md``; the kinds and their answers in
``SPEC.md``. The runner prints one ``FAIL`` line per failing case with the first difference,
then ``N passed, M failed`` alone on the last line; its exit status is 0 when every case passed,
1 when one failed, 2 when the arguments select no case.

As a module: :func:`load_cases` reads the cases, :func:`first_difference` is the comparison
rule, :func:`via_command` asks an implementation command, :func:`report` runs cases through any
``ask(case) -> answer`` and prints the outcome (refstream's ``refstream conformance`` calls it
with its in-process adapter).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# The fixtures folder beside this file: the default set of cases.
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# A case that makes an implementation run longer than this fails instead of hanging the runner.
CASE_TIMEOUT_S = 120
# Characters of a failing command's standard error shown with its failure, on its one line.
STDERR_TAIL = 300


@dataclass(frozen=True)
class Case:
    path: Path
    kind: str
    input: dict
    expected: dict
    root: Path  # the fixtures folder: media paths in ``input`` are relative to it

    @property
    def name(self) -> str:
        """The case's path relative to the fixtures folder, without ``.json``."""
        return self.path.relative_to(self.root).with_suffix("").as_posix()


@dataclass(frozen=True)
class Outcome:
    case: Case
    difference: str | None  # None when the answer equals the expectation


class Failed(Exception):
    """The implementation gave no answer to compare: it failed, timed out or wrote no object."""


def load_cases(root: Path = FIXTURES, kinds: Sequence[str] = (),
               patterns: Sequence[str] = ()) -> list[Case]:
    """Every case under ``root`` (files with a ``"kind"`` key), sorted by path; only those of
    ``kinds`` and matching one of ``patterns`` (see :func:`matches`) when given."""
    cases = []
    for path in sorted(Path(root).rglob("*.json")):
        document = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(document, dict) or "kind" not in document:
            continue  # descriptions of media files and other JSON live beside the cases
        case = Case(path, document["kind"], document["input"], document["expected"], Path(root))
        if (not kinds or case.kind in kinds) and (not patterns or matches(case, patterns)):
            cases.append(case)
    return cases


def matches(case: Case, patterns: Sequence[str]) -> bool:
    """Whether a ``--case`` pattern names the case: its path relative to the fixtures folder,
    with or without ``.json``, or a shell-style pattern of it (``'meta/valid-*'``)."""
    return any(fnmatch.fnmatchcase(case.name, pattern.removesuffix(".json"))
               for pattern in patterns)


def first_difference(expected, actual, where: str = "") -> str | None:
    """The first place where two JSON values differ, or None when they are equal (README.md,
    "Comparing answers"): same keys, same lengths, numbers by value, a boolean never a number."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        # "error" first: an error where an answer was expected (or none where one was) says so.
        for key in sorted(set(expected) | set(actual), key=lambda k: (k != "error", k)):
            if key not in actual:
                return f"{where}.{key}: missing (expected {_short(expected[key])})"
            if key not in expected:
                return f"{where}.{key}: unexpected key (got {_short(actual[key])})"
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
    if _same_kind(expected, actual) and expected == actual:
        return None
    return f"{where or '.'}: expected {_short(expected)}, got {_short(actual)}"


def _same_kind(a, b) -> bool:
    """Whether two JSON scalars may be compared by value: numbers with numbers (int or float),
    strings with strings, booleans with booleans, null with null."""
    def kind(value):
        if isinstance(value, bool) or value is None:
            return type(value)
        return float if isinstance(value, int | float) else type(value)

    return kind(a) is kind(b)


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse_constant(token: str):
    raise ValueError(f"{token} is not JSON")


def parse_answer(data: bytes) -> dict:
    """One JSON object (RFC 8259: no ``NaN`` or ``Infinity``) from an implementation's output;
    :class:`Failed` otherwise."""
    try:
        answer = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise Failed(f"not one JSON object: {_short(data.decode('utf-8', 'replace'))} "
                     f"({exc})") from None
    if not isinstance(answer, dict):
        raise Failed(f"not a JSON object: {_short(answer)}")
    return answer


def via_command(command: str, root: Path = FIXTURES) -> Callable[[Case], dict]:
    """Ask an implementation command (split into words like a POSIX shell would, no shell run),
    one process per case, inside the fixtures folder ``root``."""
    argv = shlex.split(command)
    if not argv:
        raise ValueError("the implementation command is empty")

    def ask(case: Case) -> dict:
        request = json.dumps({"kind": case.kind, "input": case.input}, ensure_ascii=False)
        try:
            done = subprocess.run(argv, input=request.encode("utf-8"), capture_output=True,
                                  timeout=CASE_TIMEOUT_S, cwd=root)
        except subprocess.TimeoutExpired:
            raise Failed(f"timed out after {CASE_TIMEOUT_S} s") from None
        except OSError as exc:
            raise Failed(f"cannot start {argv[0]!r}: {exc}") from None
        if done.returncode != 0:
            lines = done.stderr.decode("utf-8", "replace").split("\n")
            tail = " | ".join(line.strip() for line in lines if line.strip())[-STDERR_TAIL:]
            raise Failed(f"exit status {done.returncode}: {tail}")
        return parse_answer(done.stdout)

    return ask


def judge(case: Case, ask: Callable[[Case], dict]) -> Outcome:
    """The outcome of one case: the first difference of its answer, or why there is none."""
    try:
        answer = ask(case)
    except Failed as exc:
        return Outcome(case, f"no answer: {exc}")
    return Outcome(case, first_difference(case.expected, answer))


def run(cases: Sequence[Case], ask: Callable[[Case], dict], jobs: int = 1) -> Iterator[Outcome]:
    """Every case's outcome, in the order of ``cases``; ``jobs`` cases are asked at once."""
    if jobs <= 1:
        yield from (judge(case, ask) for case in cases)
        return
    with ThreadPoolExecutor(jobs) as pool:
        yield from pool.map(lambda case: judge(case, ask), cases)


def report(cases: Sequence[Case], ask: Callable[[Case], dict], jobs: int = 1, out=None) -> int:
    """Run ``cases`` and print a ``FAIL`` line per failing case, then ``N passed, M failed``;
    returns the exit status (0 when every case passed, else 1)."""
    out = out or sys.stdout
    failed = 0
    for outcome in run(cases, ask, jobs):
        if outcome.difference is not None:
            failed += 1
            case = outcome.case
            print(f"FAIL {case.name}.json [{case.kind}] {outcome.difference}", file=out,
                  flush=True)
    print(f"{len(cases) - failed} passed, {failed} failed", file=out, flush=True)
    return 0 if failed == 0 else 1


def add_selection(parser: argparse.ArgumentParser) -> None:
    """The options that choose cases: ``--kind``, ``--case``, ``--jobs``."""
    parser.add_argument("--kind", action="append", default=[],
                        help="only cases of this kind (repeatable)")
    parser.add_argument("--case", action="append", default=[], metavar="PATTERN",
                        help="only this case: its path under fixtures/, with or without .json, "
                             "or a shell-style pattern such as 'meta/valid-*' (repeatable)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="cases run at once (default 1)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run the conformance cases against an implementation command (README.md).")
    parser.add_argument("--impl", required=True, metavar="CMD",
                        help="the implementation command, run once per case inside the fixtures "
                             "folder (paths in it are relative to that folder)")
    parser.add_argument("--fixtures", type=Path, default=FIXTURES,
                        help="the fixtures folder (default: the one beside this file)")
    add_selection(parser)
    args = parser.parse_args(argv)
    cases = load_cases(args.fixtures, args.kind, args.case)
    if not cases:
        print(f"run.py: no case in {args.fixtures} matches --kind {args.kind} --case "
              f"{args.case}", file=sys.stderr)
        return 2
    return report(cases, via_command(args.impl, args.fixtures), args.jobs)


if __name__ == "__main__":
    sys.exit(main())

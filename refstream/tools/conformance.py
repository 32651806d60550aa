"""Run the golden fixtures in ``spec/fixtures`` against an implementation, with spec's runner.

The runner and the comparison rule are ``spec/run.py`` (standard library only, beside the
fixtures: :func:`load_runner` loads it from there), so ``refstream conformance`` and
``python3 spec/run.py`` are one runner; the protocol is in ``spec/README.md``, the kinds in
``spec/SPEC.md``. refstream's own adapter answers one case through the protocol
(``python -m refstream.tools.conformance``) or in-process (:func:`in_process`), through the same
JSON round trip. An installed refstream needs ``--fixtures``: the fixtures are not installed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

from refstream.errors import UsageError
from refstream.tools.adapters import ADAPTERS, FIXTURES_DIR, answer

__all__ = ["ADAPTERS", "FIXTURES_DIR", "answer", "fixtures_folder", "load_runner", "in_process"]


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


@cache
def load_runner(fixtures: Path = FIXTURES_DIR) -> ModuleType:
    """``run.py`` of the ``spec/`` folder that holds ``fixtures``; UsageError when it is not
    there (a fixtures folder copied without its ``spec/``)."""
    path = Path(fixtures).resolve().parent / "run.py"
    if not path.is_file():
        raise UsageError(f"no runner {path} beside the fixtures {fixtures}: pass the fixtures "
                         "folder of a whole spec/ folder (spec/run.py and spec/fixtures)")
    spec = importlib.util.spec_from_file_location(f"spec_run_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


def load_cases(root: Path = FIXTURES_DIR, kind: str | None = None) -> list:
    return load_runner(root).load_cases(root, [kind] if kind else [])


def first_difference(expected, actual) -> str | None:
    """The runner's comparison rule (``spec/README.md``, "Comparing answers")."""
    return load_runner().first_difference(expected, actual)


def in_process(case) -> dict:
    """Ask refstream's own adapter, through the same JSON round trip as the protocol."""
    reply = answer(case.kind, json.loads(json.dumps(case.input)), case.root)
    return json.loads(json.dumps(reply))


def main_adapter() -> int:
    """The protocol end of refstream's adapter: one case on stdin, one answer on stdout; run
    inside the fixtures folder."""
    request = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    reply = json.dumps(answer(request["kind"], request["input"], Path.cwd()))
    sys.stdout.buffer.write(reply.encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main_adapter())

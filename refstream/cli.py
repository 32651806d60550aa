"""The ``refstream`` command line.

Each sub-command is a pair ``add_<name>(subparsers)`` / ``run_<name>(args) -> int`` below; the
work itself lives in the module that owns it, so this file only parses arguments and prints.
"""

from __future__ import annotations

import argparse
import sys

from refstream.errors import RefstreamError

# Sub-commands register here as (add_parser_function) in the order the help lists them.
COMMANDS: list = []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="refstream", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except RefstreamError as exc:
        print(f"refstream {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


def add_conformance(subparsers) -> None:
    p = subparsers.add_parser("conformance", help="run the spec fixtures against an implementation")
    p.add_argument("--impl", help="implementation command (default: refstream itself)")
    p.add_argument("--kind", help="only cases of this kind")
    p.add_argument("--fixtures", help="fixtures folder (default: the spec shipped with refstream)")
    p.set_defaults(run=run_conformance)


def run_conformance(args) -> int:
    from pathlib import Path

    from refstream import conformance

    root = Path(args.fixtures) if args.fixtures else conformance.FIXTURES_DIR
    cases = conformance.load_cases(root, args.kind)
    ask = conformance.via_command(args.impl, root) if args.impl else conformance.in_process
    passed = failed = 0
    for outcome in conformance.run(cases, ask):
        if outcome.difference is None:
            passed += 1
        else:
            failed += 1
            name = outcome.case.path.relative_to(root)
            print(f"FAIL {name} [{outcome.case.kind}] {outcome.difference}")
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 and passed > 0 else 1


COMMANDS.append(add_conformance)


if __name__ == "__main__":
    sys.exit(main())

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


if __name__ == "__main__":
    sys.exit(main())

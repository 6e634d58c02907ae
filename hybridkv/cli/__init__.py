"""The ``hybridkv`` command: parse arguments, call the package, print. Nothing else lives here."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from hybridkv.cli.bench import add_bench_parser
from hybridkv.cli.demo import add_demo_parser
from hybridkv.cli.generate import add_generate_parser
from hybridkv.cli.plan import add_plan_parser
from hybridkv.cli.serve import add_serve_parser
from hybridkv.cli.simulate import add_simulate_parser

Command = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridkv",
        description="Serving engine and memory planner for hybrid (attention + recurrent) LLMs.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_plan_parser(commands)
    add_simulate_parser(commands)
    add_serve_parser(commands)
    add_generate_parser(commands)
    add_bench_parser(commands)
    add_demo_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Command = args.run
    try:
        return run(args)
    except ValueError as exc:  # a user error: one line, exit status 2
        print(f"hybridkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hybridkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`hybridkv plan ... | head`): stop quietly, as cat does.
        # stdout is pointed at devnull so the interpreter's final flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0

"""The ``hybridkv`` command: parse arguments, call the package, print. Nothing else lives here."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from hybridkv.bench_cli import add_bench_parser
from hybridkv.demo_cli import add_demo_parser
from hybridkv.generate_cli import add_generate_parser
from hybridkv.plan_cli import add_plan_parser
from hybridkv.serve_cli import add_serve_parser
from hybridkv.sim_cli import add_simulate_parser

Command = Callable[[argparse.Namespace], int]


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


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
    except (CliError, ValueError) as exc:
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

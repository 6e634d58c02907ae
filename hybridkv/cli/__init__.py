"""The ``hybridkv`` command: parse arguments, call the package, print. Nothing else lives here."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from hybridkv.cli.bench import add_bench_parser
from hybridkv.cli.demo import add_demo_parser
from hybridkv.cli.generate import add_generate_parser
from hybridkv.cli.plan import add_plan_parser
from hybridkv.cli.serve import add_serve_parser
from hybridkv.cli.simulate import add_simulate_parser

Command = Callable[[argparse.Namespace], int]


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage errors in one line naming the flag (``hybridkv serve: error: ...``), exit 2.

    argparse prints the whole usage block before its message; with the dozens of flags
    vLLM users bring, the one line that matters (which flag) scrolls away.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
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


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time (tests swap it)."""

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def _configure_logging() -> None:
    """hybridkv's INFO lines (the capacity report, the engine's warnings) to stderr."""
    logger = logging.getLogger("hybridkv")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed in one line
        return exc.code if isinstance(exc.code, int) else 2
    if unknown:
        flags = [a for a in unknown if a.startswith("-")] or unknown
        command = f"{parser.prog} {args.command}"
        print(
            f"{command}: error: unrecognized argument{'s' * (len(flags) > 1)} "
            f"{' '.join(flags)}: not a hybridkv flag (see {command} --help)",
            file=sys.stderr,
        )
        return 2
    _configure_logging()
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

"""What a clean install needs is declared, and CI proves it on every run.

A module imported by hybridkv but not declared in pyproject.toml works on a developer's machine
(someone installed it by hand) and fails for a user. These tests find such imports statically
(every import statement in hybridkv/, inside functions too) and by running: every module is
imported and every subcommand's ``--help`` is run in a subprocess.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

from hybridkv.cli import build_parser
from tests.install_helpers import (
    IMPORT_EVERY_MODULE,
    ROOT,
    module_names_of_files,
    quick_start_commands,
)

PACKAGE = ROOT / "hybridkv"
CI_SCRIPT = ROOT / ".ci" / "run"


# ---------------------------------------------------------------- declared dependencies


def normalized(distribution: str) -> str:
    """PEP 503 name: ``Prometheus_Client`` and ``prometheus-client`` are one distribution."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def declared(extra: str | None = None) -> set[str]:
    """Distribution names of ``[project].dependencies``, or of one optional extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    if extra is None:
        requirements = project["dependencies"]
    else:
        requirements = project["optional-dependencies"][extra]
    return {normalized(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r).group()) for r in requirements}


def imported_names(tree: ast.AST) -> list[str]:
    """Absolute module names imported anywhere in ``tree``: statements at any depth, and
    ``importlib.import_module("name")`` / ``__import__("name")`` with a literal name."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            if called in ("import_module", "__import__") and isinstance(first, ast.Constant):
                names.append(str(first.value))
    return names


def third_party_imports() -> dict[str, set[str]]:
    """Top-level module -> the hybridkv/ files that import it (stdlib and hybridkv left out)."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in imported_names(ast.parse(path.read_text(), str(path))):
            top = name.partition(".")[0]
            if top != "hybridkv" and top not in sys.stdlib_module_names:
                found[top].add(path.relative_to(ROOT).as_posix())
    return found


def test_the_scan_sees_imports_inside_functions() -> None:
    """The scan itself: a function-level import (as cli/simulate.py imports matplotlib) is found."""
    source = "def plot():\n    import matplotlib.pyplot as plt\n    from a.b import c\n"
    source += "importlib.import_module('d.e')\n"
    assert imported_names(ast.parse(source)) == ["matplotlib.pyplot", "a.b", "d.e"]
    assert "torch" in third_party_imports()


def test_every_runtime_import_is_a_declared_dependency() -> None:
    """Each third-party module hybridkv imports comes from a distribution listed in
    ``[project].dependencies`` itself: one only pulled in by another dependency (starlette by
    fastapi) may go away when that one changes, and one in the ``test`` extra is missing for
    every user who installed without it."""
    runtime, test_only = declared(), declared("test") - declared()
    providers = importlib.metadata.packages_distributions()
    problems = []
    for module, files in sorted(third_party_imports().items()):
        dists = {normalized(d) for d in providers.get(module, [])}
        if not dists:
            problems.append(f"{module} (imported by {sorted(files)}) is not installed here")
        elif not dists & runtime:
            where = "only in the test extra" if dists & test_only else "not declared"
            problems.append(f"{module} from {sorted(dists)}: {where}; imported by {sorted(files)}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- importing and --help


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    """Every module pkgutil finds imports (new modules are covered without a list to edit).

    ``hybridkv.__main__`` runs the command line when imported; the ``--help`` tests below
    import it through ``python -m hybridkv``.
    """
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERY_MODULE], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert not report["failed"], "\n".join(f"{k}:\n{v}" for k, v in report["failed"].items())
    # A directory without __init__.py is skipped by pkgutil, and by setuptools' package
    # discovery too, so a regular install would lack it: every file must have been walked.
    expected = module_names_of_files() - {"hybridkv", "hybridkv.__main__"}
    assert set(report["modules"]) == expected


def subcommands() -> list[str]:
    """The subcommand names of ``hybridkv``, read from its argparse parser."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(sub.choices)


def test_subcommands_are_discovered() -> None:
    assert {"plan", "simulate", "serve", "generate", "bench", "demo"} <= set(subcommands())


@pytest.mark.parametrize("command", ["", *subcommands()], ids=lambda c: c or "hybridkv")
def test_help_of_every_subcommand_runs(command: str) -> None:
    argv = [sys.executable, "-m", "hybridkv", *command.split(), "--help"]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: hybridkv {command}".rstrip()), result.stdout
    assert "Traceback" not in result.stderr, result.stderr


# ---------------------------------------------------------------- CI and the README


def command_lines(script: str) -> list[str]:
    lines = (line.strip() for line in script.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_ci_runs_the_readme_test_command_as_written() -> None:
    """.ci/run's command is the README's test command, character for character."""
    install, test = quick_start_commands()
    assert "pytest" in test and "pytest" not in install
    assert command_lines(CI_SCRIPT.read_text())[-1] == test


def test_readme_test_command_runs_the_whole_suite() -> None:
    """Nothing that guards correctness is deselected: no -m/-k/--deselect/--ignore in the
    README's test command or in pytest's addopts (``slow`` tests run in CI too)."""
    test = quick_start_commands()[1]
    words = shlex.split(test.split("&&")[-1])
    pytest_args = words[words.index("pytest") + 1 :]
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    addopts = shlex.split(options["ini_options"]["addopts"])
    for arg in [*pytest_args, *addopts]:
        assert arg.partition("=")[0] not in {"-m", "-k", "--deselect", "--ignore"}, arg


PROBE = (
    'python -c \'import json, os, site, sys; print(json.dumps({"prefix": sys.prefix, '
    '"site": site.getsitepackages(), "pythonpath": os.environ.get("PYTHONPATH")}))\'; '
    "pip --version"
)


def test_ci_script_builds_a_new_environment_and_removes_it(tmp_path: Path) -> None:
    """.ci/run with its test command swapped for a probe: pip and python are a new
    environment's, made under $TMPDIR with no system site-packages and no PYTHONPATH, and
    the environment is gone when the script ends."""
    repo, tmp = tmp_path / "repo", tmp_path / "tmp"
    (repo / ".ci").mkdir(parents=True)
    tmp.mkdir()
    script = CI_SCRIPT.read_text()
    lines = script.splitlines()
    test_command = command_lines(script)[-1]
    lines[max(i for i, line in enumerate(lines) if line.strip() == test_command)] = PROBE
    (repo / ".ci" / "run").write_text("\n".join(lines) + "\n")
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        ["bash", str(repo / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    probe_line, pip_line = result.stdout.strip().splitlines()[-2:]
    probe = json.loads(probe_line)
    prefix = Path(probe["prefix"])
    assert prefix.is_relative_to(tmp), prefix
    assert all(Path(p).is_relative_to(prefix) for p in probe["site"]), probe["site"]
    assert probe["pythonpath"] is None
    assert f" from {prefix}/" in pip_line, pip_line
    assert list(tmp.iterdir()) == [], "the environment was not removed"

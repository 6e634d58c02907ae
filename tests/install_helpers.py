"""Shared by the install tests: the commands the README and docs/ show, read from the files
themselves, and a script that imports every module of hybridkv.

Tests run these strings (not copies of them), so the documentation and what is tested cannot
drift apart: edit a command in the README and the tests run the edited command.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))]


def quick_start_commands() -> list[str]:
    """The shell commands of the README's Quick start block, comments and blank lines dropped.

    Raises:
        ValueError: the README has no Quick start section with a ```bash block.
    """
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Quick start\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    block = section and re.search(r"^```bash\n(.*?)^```", section.group(1), re.M | re.S)
    if block is None:
        raise ValueError("README.md: no ```bash block under '## Quick start'")
    lines = (line.strip() for line in block.group(1).splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def documented_cli_commands() -> dict[str, str]:
    """Every ``hybridkv ...`` command line in a code block of the README or docs/*.md.

    Also the commands written inline in prose (```hybridkv bench --model DIR ...```) when they
    have arguments: a bare ```hybridkv serve``` in a sentence names a command, not an example.

    Returns:
        command (continuation lines joined, trailing ``# comment`` dropped, spaces collapsed)
        -> the file it is in.
    """
    found: dict[str, str] = {}
    for name in DOC_FILES:
        text = (ROOT / name).read_text()
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S):
            joined = re.sub(r"\\\n\s*", "", block)  # shell line continuations
            for line in joined.splitlines():
                command = re.sub(r"\s+#.*$", "", line).strip()
                if command.startswith("hybridkv "):
                    found.setdefault(" ".join(command.split()), name)
        prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
        for command in re.findall(r"`(hybridkv [a-z]+ [^`]+)`", prose):
            found.setdefault(" ".join(command.split()), name)
    return found


IMPORT_EVERY_MODULE = """
import importlib, json, pkgutil, traceback
import hybridkv
modules, failed = [], {}
def on_error(name):
    failed[name] = traceback.format_exc()
for info in pkgutil.walk_packages(hybridkv.__path__, "hybridkv.", onerror=on_error):
    if info.name == "hybridkv.__main__":
        continue
    modules.append(info.name)
    try:
        importlib.import_module(info.name)
    except BaseException:
        failed[info.name] = traceback.format_exc()
print(json.dumps({"modules": modules, "failed": failed}))
"""


def module_names_of_files() -> set[str]:
    """``hybridkv.x.y`` for every .py file under hybridkv/ (``__init__`` is the package)."""
    names = set()
    for path in (ROOT / "hybridkv").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names

"""Every repository path and every Merak module the docs name exists.

The root README, the packages' READMEs and ``docs/*.md`` are what a newcomer reads; a file that
moved or a module that was removed must not stay named there. Paths are checked as files or
folders; modules as files or folders under the packages' ``src`` (no import: the check is fast and
needs no optional dependency). CHANGELOG files are history and are not checked.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"
LIBRARIES = ("merak_core", "merak_pipe", "merak_tp", "merak_graph")
# First components of a path that name something in the repository (anything else, such as
# ``out/addition/metrics.jsonl`` or ``gpt2-small/``, is a file a user or a run makes).
REPO_TOPS = ("packages", "docs", "tests", "benchmarks", "examples", ".ci", "src", *LIBRARIES)

MODULE = re.compile(r"\b(?:" + "|".join(LIBRARIES) + r")(?:\.[A-Za-z_]\w*)+")
SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATHLIKE = re.compile(r"^[\w.\-/]+$")


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted(PACKAGES.glob("*/README.md")), *sorted((ROOT / "docs").glob("*.md"))]
    return [f for f in files if f.name != "CHANGELOG.md"]


def _src(library: str) -> Path:
    return PACKAGES / library.replace("_", "-") / "src" / library


@cache
def _tracked_names() -> frozenset[str]:
    skip = {".git", ".venv", ".nox", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", "out"}
    names = set()
    for top in ROOT.iterdir():
        if top.name in skip:
            continue
        if top.is_file():
            names.add(top.name)
            continue
        for path in top.rglob("*"):
            if not skip.intersection(path.parts):
                names.add(path.name)
    return frozenset(names)


def _defines(text: str, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", text) is not None


def module_problem(dotted: str) -> str | None:
    """None when ``dotted`` names a module, package or a name one of them defines or imports."""
    parts = dotted.split(".")
    here = _src(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if (here / part).is_dir():
            here = here / part
            continue
        if (here / f"{part}.py").is_file():
            rest = parts[i + 1 :]
            text = (here / f"{part}.py").read_text()
            if rest and not _defines(text, rest[0]):
                return f"{'.'.join(parts[: i + 1])} has no {rest[0]!r}"
            return None
        init = here / "__init__.py"
        if init.is_file() and _defines(init.read_text(), part):
            return None  # a name the package exports; what follows is an attribute
        return f"no module {'.'.join(parts[: i + 1])} (nor a name {part!r} in {'.'.join(parts[:i])})"
    return None


def _bases(doc: Path) -> list[Path]:
    bases = [ROOT, doc.parent]
    for package in PACKAGES.iterdir():
        bases += [package, package / "src"]
    return bases


def path_problem(doc: Path, token: str, alone: bool = True) -> str | None:
    """None when ``token`` is not a repository path, or is one that exists.

    ``alone``: the token is a whole code span or link, not a word of a command line (where a bare
    ``train.py`` is the user's own script).
    """
    path = token.split("#", 1)[0].split("::", 1)[0].rstrip(":,.")
    if not path or "://" in token or not PATHLIKE.match(path) or path.startswith("-"):
        return None
    if "/" not in path.strip("/"):
        # A bare file name: Python and Markdown files named on their own must exist somewhere.
        if alone and path.endswith((".py", ".md")) and path not in _tracked_names():
            return f"no file named {path} anywhere in the repository"
        return None
    first = path.removeprefix("./").split("/", 1)[0]
    if first.isupper():
        return None  # a placeholder (``DIR/gpu_check.md``, ``OUT/config.json``)
    if not (first in REPO_TOPS or path.startswith("../") or path.endswith(".md")):
        return None  # a user's own file or folder (``out/addition/metrics.jsonl``, ``gpt2-small/``)
    if any((base / path).exists() for base in _bases(doc)):
        return None
    return f"no path {path}"


def problems(doc: Path) -> list[str]:
    text = doc.read_text()
    found = []
    for token in SPAN.findall(text) + LINK.findall(text):
        words = token.split()
        for word in words:
            problem = path_problem(doc, word.strip("()[]'\","), alone=len(words) == 1)
            if problem:
                found.append(problem)
    for dotted in MODULE.findall(text):
        problem = module_problem(dotted.rstrip("."))
        if problem:
            found.append(problem)
    return list(dict.fromkeys(found))


def test_every_path_and_module_the_docs_name_exists() -> None:
    assert len(doc_files()) > 20
    bad = [f"{doc.relative_to(ROOT)}: {p}" for doc in doc_files() for p in problems(doc)]
    assert bad == [], "\n".join(bad)


def test_the_check_finds_a_stale_path_and_a_removed_module(tmp_path: Path) -> None:
    doc = tmp_path / "stale.md"
    doc.write_text(
        "See `packages/merak-core/src/merak_core/checkpoint.py`, [design](../DESIGN-missing.md),\n"
        "`merak_core.tp_probe`, `merak_core.parallel.layout.NoSuchThing` and `merak_pipe.validate`;\n"
        "a user's `out/run/metrics.jsonl` and `torchrun train.py` are not repository paths;\n"
        "`see_design.md` is one.\n"
    )
    found = problems(doc)
    assert found == [
        "no path packages/merak-core/src/merak_core/checkpoint.py",
        "no file named see_design.md anywhere in the repository",
        "no path ../DESIGN-missing.md",
        "no module merak_core.tp_probe (nor a name 'tp_probe' in merak_core)",
        "merak_core.parallel.layout has no 'NoSuchThing'",
    ]

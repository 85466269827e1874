"""Merak's task runner: tests, the per-package matrix, lint, types, the demo, benchmarks.

``nox`` with no arguments runs what CI runs (lint, typecheck, the full suite with the
transformers tests in one environment, each library package tested alone); ``nox -s gpu`` is the GPU check
(not a default session: it needs a CUDA build of torch, see its docstring). Every session installs torch through
``constraints.txt`` (``torch==2.13.0``, a CPU build on these machines: an
unpinned ``torch`` pulls a multi-GB CUDA build). Environments are reused
between runs; ``nox --reuse-venv=no`` rebuilds them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
# One ruff for everyone: the formatter's output changes between releases.
RUFF = "ruff==0.17.6"
TEST_DEPS = ("pytest>=8", "hypothesis>=6.100", "pytest-xdist>=3.5")
# One pytest worker per core, at most four: much of the suite waits (subprocesses starting,
# timeouts that a fault test must see expire, one rank blocked on another), and a second worker
# can fill that time. ``loadgroup``: the ``slow`` tests (merak train / torchrun jobs) run one after
# another on one worker, never two jobs at once (see [Note: subprocess tests in one line] in
# tests/conftest.py). ``-- -n 0`` runs in one process (a later ``-n`` wins).
# ``--durations``: the slowest tests of each run, to see where CI's minutes go.
WORKERS = ("-n", "auto", "--maxprocesses", "4", "--dist", "loadgroup", "--durations=40")
LIBRARIES = ("pipe", "graph", "tp")
EXTRAS_FOR_TESTS = ("graph", "tp")  # libraries whose package session installs their [transformers] extra
ALL_PACKAGES = ("packages/merak-pipe", "packages/merak-graph", "packages/merak-tp", "packages/merak-core")
# One thread per process: many ranks share 2 cores (see DEVELOPERS / README).
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}

nox.options.reuse_venv = "yes"
# uv makes and fills the environments when it is installed (``.ci/run`` and the README's commands
# install it beside nox): it unpacks torch once into its cache and links it into each environment.
# A fresh clone's six environments took 6 min with uv against more than 18 min for the first three
# with pip, on the same loaded 2-core machine (load average ~30). Without uv, nox falls back to
# virtualenv and pip.
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["lint", "typecheck", "tests", "package"]
nox.options.error_on_missing_interpreters = True


def _pip_find_links() -> str | None:
    """pip's ``find-links`` setting (a folder of local wheels, e.g. the CPU build of torch), if any.

    uv reads no pip configuration; on machines whose torch wheel comes from a local folder that pip
    is configured to search, uv must be told too, or it resolves ``torch==2.13.0`` to PyPI's CUDA
    build (gigabytes).
    """
    raw = os.environ.get("PIP_FIND_LINKS", "")
    if not raw:
        try:
            out = subprocess.run(
                [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        raw = out.stdout if out.returncode == 0 else ""
    # uv fails on a folder that is not there; pip skips it with a warning.
    links = [link for link in raw.split() if "://" in link or os.path.exists(link)]
    return ",".join(links) or None  # uv reads a comma-separated list


if "UV_FIND_LINKS" not in os.environ and (_links := _pip_find_links()):
    os.environ["UV_FIND_LINKS"] = _links


def _install_all(session: nox.Session, *extra: str) -> None:
    editable = [arg for pkg in ALL_PACKAGES for arg in ("-e", pkg)]
    session.install(*CONSTRAINTS, *editable, *extra)


@nox.session
def tests(session: nox.Session) -> None:
    """merak-core's and the end-to-end tests, the transformers tests included (CI runs it).

    Each library's own tests (tests/pipe, tests/graph, tests/tp) run once, in that library's
    ``package`` session, where it is installed alone; running them here too would only repeat them
    (2666 s of test time in one run on the loaded 2-core machine). Arguments after ``--`` that
    name test paths replace that selection (``nox -s tests -- tests/pipe -x`` runs the pipe tests
    in this environment); other arguments are added to it.
    """
    # tensorboard, wandb, mlflow-skinny, pyarrow, datasets: the optional extras whose tests (event files, a W&B
    # offline run, an MLflow file store, parquet, saved datasets) run here; peft: the LoRA tests' single-process
    # reference (tests/e2e/test_lora.py); lm-eval: the merak lm-eval model's test (tests/e2e/test_lm_eval.py).
    # One install: one resolution of every requirement together.
    _install_all(
        session,
        *TEST_DEPS,
        "transformers>=5",
        "safetensors",
        "tensorboard",
        "wandb",
        "mlflow-skinny",
        "pyarrow",
        "datasets",
        "peft",
        "lm-eval>=0.4,<0.5",
    )
    selection = ["tests", *(f"--ignore=tests/{name}" for name in LIBRARIES)]
    named_paths = any(os.path.exists(arg.split("::")[0]) for arg in session.posargs)
    args = list(session.posargs) if named_paths else [*selection, *session.posargs]
    session.run("pytest", *WORKERS, *args, env={**ENV, "HF_HUB_OFFLINE": "1"})


@nox.session
@nox.parametrize("library", LIBRARIES)
def package(session: nox.Session, library: str) -> None:
    """One library installed alone, with only its declared dependencies; its own tests.

    merak-graph and merak-tp come with their ``transformers`` extra (declared, optional), so their
    tests against tiny transformers models run here: this is the only session that runs them.
    """
    extra = "[transformers]" if library in EXTRAS_FOR_TESTS else ""
    session.install(*CONSTRAINTS, f"packages/merak-{library}{extra}", *TEST_DEPS)
    # A reused environment must test the current source, whatever its version says.
    session.install(*CONSTRAINTS, "--force-reinstall", "--no-deps", f"packages/merak-{library}")
    others = [f"merak_{name}" for name in (*LIBRARIES, "core") if name != library]
    session.run(
        "python",
        "-c",
        "import importlib.util, sys; present = [m for m in sys.argv[1:] if importlib.util.find_spec(m)]; "
        "sys.exit(f'other Merak packages are installed: {present}' if present else 0)",
        *others,
    )
    # Import the installed copy, not the source tree, and only this package's tests. The test
    # harness's own tests (tests/support_tests) run once, in the ``tests`` session.
    session.run(
        "pytest",
        *WORKERS,
        f"tests/{library}",
        "tests/test_boundaries.py",
        "-p",
        "no:cacheprovider",
        *session.posargs,
        env={**ENV, "HF_HUB_OFFLINE": "1"},
    )


@nox.session
def transformers(session: nox.Session) -> None:
    """Only the tests against tiny, randomly initialised transformers models (no downloads).

    Not a default session: ``tests`` runs them too. Kept for a quick look at the transformers families.
    """
    _install_all(session, *TEST_DEPS, "transformers>=5", "safetensors")
    session.run("pytest", "tests", "-m", "transformers", *session.posargs, env={**ENV, "HF_HUB_OFFLINE": "1"})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over packages, tests, benchmarks and examples: the lint rules (complexity included) and the format."""
    session.install(RUFF)
    paths = ("packages", "tests", "benchmarks", "examples", "noxfile.py")
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the package sources."""
    _install_all(session, "mypy>=1.10", "types-PyYAML")
    session.run("mypy", *(f"{pkg}/src" for pkg in ALL_PACKAGES))


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: a real 3D-parallel training run on CPU (8 gloo ranks, dp=2 tp=2 pp=2).

    A small GPT-style model learns 2-digit addition; prints loss, tokens/s and accuracy,
    and leaves out/addition/{metrics.jsonl, loss.png, summary.json}. Extra arguments are
    job overrides, e.g. ``nox -s demo -- training.max_steps=100``.
    """
    _install_all(session, "matplotlib")
    session.run("merak", "train", "examples/addition/config.yaml", *session.posargs, env=ENV)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The GPU check, a thin wrapper: ``python -m tests.gpu.run --out gpu-check`` with the sources on PYTHONPATH.

    Not in the default sessions. It installs nothing and makes no environment: it runs the
    ``python`` on PATH (the GPU image's, whose torch is a CUDA build) on the repository's sources,
    exactly what a machine without nox runs (docs/devices.md gives the one-line command). Arguments
    after ``--`` go to the check (``--only``, ``--nproc``, ``--threads``, ``--out``); the report is
    written to ``gpu-check/gpu_check.json`` and ``.md`` unless ``--out`` says otherwise.
    """
    sources = [str(ROOT / pkg / "src") for pkg in ALL_PACKAGES] + [str(ROOT)]
    env = {**ENV, "PYTHONPATH": os.pathsep.join(sources)}
    out = [] if "--out" in session.posargs else ["--out", str(ROOT / "gpu-check")]
    session.run("python", "-m", "tests.gpu.run", *out, *session.posargs, env=env, external=True)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks under benchmarks/ (ratios measured in one run; results printed)."""
    _install_all(session, "numpy")
    names = session.posargs or sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py"))
    for name in names:
        session.run("python", os.path.join("benchmarks", name), env=ENV)

"""The wheel built from this repository is whole: every package and its data, importable alone.

The wheel is built from a copy of the tree (setuptools writes build/ and *.egg-info/ beside the
sources), installed without dependencies into a fresh virtualenv in a temporary folder, and run
there with the working directory outside the tree. The dependencies come from the virtualenv
running the tests, named by a plain path in a .pth file: Python adds that folder to sys.path but
does not run the .pth files inside it, so the editable install's finder, which would map
`shared` back to the source tree, stays off (asserted, along with every module's file).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "bundle_client", "modal_app", "cost_model", "bench")
# Read by path at run time (pyproject's package-data); each must travel in the wheel.
DATA_FILES = (
    "shared/models/tiny_corpus.txt",
    "shared/requirements-deploy.txt",
    "cost_model/data/catalogue.json",
)
# Not sources of the wheel: caches, environments, build outputs, and folders no package holds.
NOT_COPIED = shutil.ignore_patterns(
    ".git",
    ".venv*",
    "__pycache__",
    "*.pyc",
    "*.egg-info",
    "build",
    "dist",
    ".*_cache",
    ".hypothesis",
    "results",
)
STEP_TIMEOUT_S = 120  # each step takes seconds; the bound is for a loaded 2-core box


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, list[str]]]:
    """(the fresh venv's python, its site-packages, the wheel's file names)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=NOT_COPIED)
    dist = work / "dist"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
        ]
    )
    (wheel,) = dist.glob("*.whl")
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheel),
        ]
    )
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip())
    # The dependencies: this test run's own site-packages, as a plain path (no .pth runs there).
    (site / "test-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    yield python, site, names


def _run(command: list[str], cwd: Path | None = None) -> str:
    """Run outside the tree with no PYTHONPATH (this run's points at the sources); its stdout."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTHON", "BUNDLE_", "VIRTUAL_ENV"))
    }
    done = subprocess.run(
        command,
        cwd=cwd or Path("/"),
        env=env,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
        check=False,
    )
    shown = " ".join(part[:60] for part in command[:4])
    assert done.returncode == 0, f"{shown} exited {done.returncode}: {done.stderr[-3000:]}"
    return done.stdout


def _modules(names: list[str]) -> list[str]:
    """The wheel's modules by dotted name, less `__main__` ones (run, not imported: the entry
    point test runs them)."""
    found = []
    for name in names:
        if not name.endswith(".py") or name.split("/", 1)[0] not in PACKAGES or name.endswith("/__main__.py"):
            continue
        parts = name[: -len(".py")].split("/")
        found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(found)


def test_the_wheel_holds_every_package_of_the_tree_and_its_data(
    installed: tuple[Path, Path, list[str]],
) -> None:
    names = installed[2]
    for package in PACKAGES:
        for init in (ROOT / package).rglob("__init__.py"):
            assert str(init.relative_to(ROOT)) in names, f"{init.parent.relative_to(ROOT)} is not in the wheel"
    assert "shared/responses/manager.py" in names  # the package a hand-kept list once left out
    assert set(DATA_FILES) <= set(names)
    assert not [name for name in names if name.startswith(("tests/", "cog/"))]  # cog/ is no package


def test_every_module_imports_from_the_installed_wheel(
    installed: tuple[Path, Path, list[str]], tmp_path: Path
) -> None:
    python, site, names = installed
    modules = _modules(names)
    assert len(modules) > 100 and "shared.responses.request" in modules
    script = textwrap.dedent(
        f"""
        import importlib, sys
        from pathlib import Path
        site = Path({str(site)!r})
        finders = [type(f).__module__ for f in sys.meta_path if "editable" in type(f).__module__]
        assert not finders, f"the source tree's editable finder is active: {{finders}}"
        for name in {modules!r}:
            module = importlib.import_module(name)
            assert site in Path(module.__file__).parents, f"{{name}} came from {{module.__file__}}"
        from shared.models.tiny_model import _corpus
        from cost_model.catalogue import load_packaged
        from modal_app.app import PACKAGES
        assert len(_corpus()) > 10 and load_packaged() and PACKAGES
        print(len({modules!r}))
        """
    )
    assert _run([str(python), "-c", script], cwd=tmp_path).strip() == str(len(modules))


@pytest.mark.parametrize(
    ("command", "words"),
    [
        (["shared.serve", "--help"], "--port"),
        (["cost_model", "estimate", "--help"], "--requests-per-day"),
        (["bench", "--help"], "startup"),
    ],
)
def test_the_entry_points_run_from_the_wheel(
    installed: tuple[Path, Path, list[str]], tmp_path: Path, command: list[str], words: str
) -> None:
    python = installed[0]
    assert words in _run([str(python), "-m", *command], cwd=tmp_path)

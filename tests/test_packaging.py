"""What the built package promises: `shardtensor.__version__`, the one source of the version that
pyproject.toml reads, and the `py.typed` marker that tells type checkers the package is typed, shipped
as package data; and that `pip wheel .` builds a wheel that installs into a fresh venv and runs the demo."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

from helpers import SMALL_DEMO_FLAGS

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


def _copy_project(destination: Path) -> Path:
    """The files a build reads (pyproject, README, src), without caches or the checkout's build output."""
    destination.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, destination / name)
    shutil.copytree(ROOT / "src", destination / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return destination


def _fresh_venv(path: Path) -> Path:
    """A new venv that sees the running interpreter's installed packages (the pinned torch, numpy, rich)
    through a `.pth` line after its own site-packages, so nothing is downloaded; shardtensor itself is
    installed into it from the wheel and imported from there."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, capture_output=True, timeout=120)
    python = path / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         check=True, capture_output=True, text=True).stdout.strip()
    (Path(own) / "outer_site_packages.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


def _without_pythonpath() -> dict:
    """The environment for the fresh venv's processes: a PYTHONPATH pointing at the checkout would
    import shardtensor from there instead of from the installed wheel."""
    return {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}


def test_pip_wheel_builds_a_wheel_that_installs_into_a_fresh_venv_and_runs_the_demo(tmp_path):
    project = _copy_project(tmp_path / "project")
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(project)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = wheels.glob("shardtensor-*.whl")
    assert wheel.name.startswith(f"shardtensor-{shardtensor.__version__}-py3-none-any")
    with zipfile.ZipFile(wheel) as archive:
        assert "shardtensor/py.typed" in archive.namelist()

    python = _fresh_venv(tmp_path / "venv")
    installed = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--force-reinstall", str(wheel)],
                               capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    check = ("import pathlib, sys, shardtensor; "
             "assert pathlib.Path(shardtensor.__file__).is_relative_to(sys.prefix), shardtensor.__file__; "
             "print(shardtensor.__version__)")
    imported = subprocess.run([str(python), "-c", check], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env=_without_pythonpath())
    assert imported.returncode == 0 and imported.stdout.strip() == shardtensor.__version__, imported.stderr[-3000:]

    demo = subprocess.run([str(tmp_path / "venv" / "bin" / "shardtensor-demo"), *SMALL_DEMO_FLAGS, "--mesh", "1x2"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=_without_pythonpath())
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert demo.stderr == "", demo.stderr
    assert "3/3" in demo.stdout and "sample" in demo.stdout

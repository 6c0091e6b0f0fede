"""Packaging: the repository root is the `miles` package, each folder below it a subpackage.

setup.cfg holds the setuptools configuration and pyproject.toml the metadata. This file does
the one thing a declarative file cannot: it finds the subpackages under the `miles.` prefix,
so a new folder with an `__init__.py` installs as `miles.<folder>` with no edit here.
"""

from configparser import ConfigParser
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def not_packaged() -> list[str]:
    """setup.cfg's folders that are not part of the installed package, with their subfolders."""
    cfg = ConfigParser()
    cfg.read(HERE / "setup.cfg")
    folders = cfg["miles.packaging"]["not_packaged"].split()
    return [*folders, *(f"{f}.*" for f in folders)]


def packages() -> list[str]:
    """`miles` plus `miles.<dotted folder>` for every package folder below the root."""
    return ["miles", *(f"miles.{name}" for name in find_packages(str(HERE), exclude=not_packaged()))]


class BuildPy(build_py):
    """The root package's modules, less this file (it sits in the root, but is no module)."""

    def find_package_modules(self, package, package_dir):
        found = super().find_package_modules(package, package_dir)
        return [m for m in found if not (package == "miles" and m[1] == "setup")]


if __name__ == "__main__":
    setup(packages=packages(), cmdclass={"build_py": BuildPy})

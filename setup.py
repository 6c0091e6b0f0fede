"""Packaging: the repository root is the `miles` package, each folder below it a subpackage.

The subpackages are found, not listed: a new folder with an `__init__.py` installs as
`miles.<folder>` with no edit here. Everything else (name, dependencies, scripts) is in
pyproject.toml.
"""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

# Folders of the repository that are not part of the installed package.
NOT_PACKAGED = ["tests", "tests.*", "bench", "bench.*", "scripts", "scripts.*", "examples",
                "examples.*", "docs", "docs.*", "build", "build.*"]


def packages() -> list[str]:
    """`miles` plus `miles.<dotted folder>` for every package folder below the root."""
    return ["miles", *(f"miles.{name}" for name in find_packages(".", exclude=NOT_PACKAGED))]


class BuildPy(build_py):
    """The root package's modules, less this file (it sits in the root, but is no module)."""

    def find_package_modules(self, package, package_dir):
        found = super().find_package_modules(package, package_dir)
        return [m for m in found if not (package == "miles" and m[1] == "setup")]


if __name__ == "__main__":
    setup(
        package_dir={"miles": "."},
        packages=packages(),
        package_data={"miles.rollout.envs": ["*.json", "*.jinja"]},
        cmdclass={"build_py": BuildPy},
    )

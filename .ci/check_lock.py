"""Fail when constraints.txt (the lock CI installs from) and pyproject.toml disagree.

Every requirement of the project (``dependencies`` and the ``dev`` extra the README's test command
installs) must be pinned in the lock (``name==version``), and the pinned version must satisfy the
requirement's range. Run by ``.ci/run`` before the test command, and by ``tests/unit/test_lock.py``.

Usage: ``python .ci/check_lock.py [ROOT]``; exit status 1 with one line per disagreement.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

LOCK = "constraints.txt"
EXTRAS = ("dev",)
#: The Python the lock is for (CI's): requirements whose markers exclude it are not checked.
LOCK_PYTHON = "3.11"


def read_lock(path: Path) -> dict[str, Version]:
    """``{canonical name: version}`` of the ``name==version`` lines of ``path``."""
    pins: dict[str, Version] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        if not match:
            raise ValueError(f"{path}:{number}: not a 'name==version' pin: {line!r}")
        pins[canonicalize_name(match[1])] = Version(match[2])
    return pins


def project_requirements(pyproject: Path) -> list[Requirement]:
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = [Requirement(r) for r in project.get("dependencies", [])]
    for extra in EXTRAS:
        requirements += [Requirement(r) for r in project.get("optional-dependencies", {}).get(extra, [])]
    return requirements


def disagreements(root: Path) -> list[str]:
    pins = read_lock(root / LOCK)
    problems = []
    environment = {"python_version": LOCK_PYTHON, "python_full_version": f"{LOCK_PYTHON}.0", "extra": ""}
    for requirement in project_requirements(root / "pyproject.toml"):
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        name = canonicalize_name(requirement.name)
        pinned = pins.get(name)
        if pinned is None:
            problems.append(f"{requirement.name}: required by pyproject.toml ({requirement}) but not pinned in {LOCK}")
        elif requirement.specifier and not requirement.specifier.contains(pinned, prereleases=True):
            problems.append(f"{requirement.name}: {LOCK} pins {pinned}, outside pyproject.toml's {requirement.specifier}")
    return problems


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1]
    problems = disagreements(root)
    for problem in problems:
        print(f"check_lock: {problem}", file=sys.stderr)
    if problems:
        print(f"check_lock: {LOCK} and pyproject.toml disagree ({len(problems)}); regenerate the lock"
              " (bench/compat/lock.sh) or fix the range", file=sys.stderr)
        return 1
    print(f"check_lock: {LOCK} pins every requirement of pyproject.toml inside its range")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

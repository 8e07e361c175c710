"""The CPU profile's pins: requirements.txt names what the project uses, requirements-lock.txt pins exactly what that
pulls in (read from the installed packages' metadata), so a fresh `scripts/setup.sh` installs no more and no less."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
INSTALLER_PACKAGES = {"pip", "setuptools", "wheel"}  # the venv's own; `pip freeze` leaves them out of a lock


def pins(path: Path) -> dict[str, str]:
    """``{canonical name: version}`` of a ``name==version`` requirements file."""
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return {canonicalize_name(name): version for name, version in (line.split("==") for line in lines if line)}


def installed_closure(names: list[str]) -> set[str]:
    """``names`` and everything they require as installed here, extras included; absent packages are skipped."""
    found, stack, done = set(), [(name, frozenset()) for name in names], set()
    while stack:
        name, extras = stack.pop()
        if (canonicalize_name(name), extras) in done:
            continue
        done.add((canonicalize_name(name), extras))
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:  # e.g. torchvision, which setup.sh removes from the CPU profile
            continue
        found.add(canonicalize_name(name))
        for line in requires:
            requirement = Requirement(line)
            environments = [{"extra": extra} for extra in extras or {""}]
            if requirement.marker is None or any(requirement.marker.evaluate(e) for e in environments):
                stack.append((requirement.name, frozenset(requirement.extras)))
    return found


def test_every_direct_pin_is_locked_at_the_same_version():
    direct, lock = pins(ROOT / "requirements.txt"), pins(ROOT / "requirements-lock.txt")
    assert {name: (version, lock.get(name)) for name, version in direct.items() if lock.get(name) != version} == {}


def test_the_lock_is_exactly_what_the_direct_pins_pull_in():
    lock = set(pins(ROOT / "requirements-lock.txt"))
    closure = installed_closure(list(pins(ROOT / "requirements.txt"))) - INSTALLER_PACKAGES
    assert (sorted(closure - lock), sorted(lock - closure)) == ([], [])


def test_the_packages_dependencies_are_pinned_in_the_cpu_profile():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    lock = pins(ROOT / "requirements-lock.txt")
    assert [name for name in declared if canonicalize_name(Requirement(name).name) not in lock] == []

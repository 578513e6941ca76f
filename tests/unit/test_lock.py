"""The lock CI installs from (``constraints.txt``) agrees with ``pyproject.toml``
(``.ci/check_lock.py``, which ``.ci/run`` also runs before installing), and the check catches a
pin outside a range or a missing pin."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _check_lock():
    spec = importlib.util.spec_from_file_location("check_lock", ROOT / ".ci" / "check_lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lock_pins_every_requirement_inside_its_range():
    assert _check_lock().disagreements(ROOT) == []


def test_lock_check_catches_disagreements(tmp_path):
    check = _check_lock()
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    lock = (ROOT / "constraints.txt").read_text()
    (tmp_path / "constraints.txt").write_text(lock.replace("megatron-core==", "megatron-core==0.99.0\n# was ")
                                              .replace("\npluggy==", "\n# pluggy=="))  # fmt: skip
    problems = check.disagreements(tmp_path)
    assert any("megatron-core" in p and "outside" in p for p in problems), problems
    assert any("pluggy" in p and "not pinned" in p for p in problems), problems
    assert check.main(["check_lock", str(tmp_path)]) == 1

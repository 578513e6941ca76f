#!/usr/bin/env bash
# Regenerate constraints.txt (the lock CI installs from): a fresh Python 3.11 venv, the project
# with its dev extra at the newest releases pyproject.toml admits (torch pinned to the CPU build),
# then `pip freeze`. Review the diff, run .ci/check_lock.py and the tests, and commit it.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY311=${PY311:-$(command -v python3.11 || echo python3)}
VENV=$(mktemp -d)/venv
"$PY311" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0" -e "$ROOT[dev]"
{
  sed -n '/^#/p' "$ROOT/constraints.txt"
  "$VENV/bin/python" -m pip freeze --exclude-editable | grep -v '^mcore-zoo' | sed 's/^torch==\([0-9.]*\)+cpu$/torch==\1/'
} > "$ROOT/constraints.txt.new"
mv "$ROOT/constraints.txt.new" "$ROOT/constraints.txt"
"$VENV/bin/python" "$ROOT/.ci/check_lock.py" "$ROOT"
echo "constraints.txt regenerated from $("$VENV/bin/python" --version) ($(date -I))"

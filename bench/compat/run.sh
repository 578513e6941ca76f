#!/usr/bin/env bash
# Compatibility matrix: one fresh virtual environment per point of the declared dependency ranges,
# the core suite (tests/unit and tests/parity) and `mcore-zoo parity-report --arch all` in each.
#
#   bash bench/compat/run.sh                 # every point below
#   bash bench/compat/run.sh tf-5.17 mc-0.19 # some of them
#
# Writes out/compat/<point>.json (versions, pass / fail / skip counts, the parity verdict, the
# date, seconds) and out/compat/<point>.log; docs/compat.md records the results. The points:
#
#   tf-low    Python 3.11, megatron-core 0.16.x, transformers at pyproject.toml's lower bound
#   tf-5.17   Python 3.11, megatron-core 0.16.x, transformers 5.17.0 (the GPU machine's)
#   lock      Python 3.11, everything from constraints.txt (what CI runs)
#   newest    Python 3.11, no lock: the newest releases pyproject.toml admits
#   mc-0.19   Python 3.12, megatron-core 0.19.x, torch 2.11 (PyPI's CUDA build, run on the CPU),
#             transformers 5.17.0 (the GPU machine's stack without Transformer Engine)
#   tf-X.Y.Z  Python 3.11, megatron-core 0.16.x, transformers X.Y.Z (probing a range's edge)
#
# CPU only; each point takes a few minutes to install (the CUDA build of torch: ~3 GB) and
# 5-10 minutes to test on 2 cores.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$ROOT/out/compat}
WORK=${WORK:-/tmp/mcore-zoo-compat}
PY311=${PY311:-$(command -v python3.11 || echo python3)}
PY312=${PY312:-$(for p in "$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3.12" \
                         "${PYENV_ROOT:-$HOME/.pyenv}/versions/3.12.1/bin/python3.12"; do
                   [ -x "$p" ] && { echo "$p"; exit; }; done; command -v python3.12)}
TF_LOW=$("$PY311" - "$ROOT/pyproject.toml" <<'PY'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
spec = next(d for d in deps if re.match(r"transformers\b", d))
print(re.search(r">=\s*([0-9][^,\s]*)", spec).group(1))
PY
)
POINTS=("$@")
[ ${#POINTS[@]} -gt 0 ] || POINTS=(tf-low tf-5.17 lock newest mc-0.19)
mkdir -p "$OUT" "$WORK"

install() {  # point -> pip arguments after "-e $ROOT[dev]"
  case "$1" in
    tf-low)  echo "$PY311" "torch==2.13.0 transformers==$TF_LOW" ;;
    tf-5.17) echo "$PY311" "torch==2.13.0 transformers==5.17.0" ;;
    lock)    echo "$PY311" "-c $ROOT/constraints.txt" ;;
    newest)  echo "$PY311" "torch==2.13.0" ;;
    mc-0.19) echo "$PY312" "torch==2.11.0 megatron-core==0.19.2 transformers==5.17.0" ;;
    tf-[0-9]*) echo "$PY311" "torch==2.13.0 transformers==${1#tf-}" ;;  # any other transformers release
    *) echo "unknown point $1" >&2; return 2 ;;
  esac
}

for point in "${POINTS[@]}"; do
  read -r python extra <<<"$(install "$point")" || exit 2
  venv="$WORK/$point"; log="$OUT/$point.log"
  start=$(date +%s)
  echo "== $point: $python, $extra" | tee "$log"
  rm -rf "$venv" && "$python" -m venv "$venv"
  # shellcheck disable=SC2086
  if ! "$venv/bin/python" -m pip install -q --upgrade pip >>"$log" 2>&1 \
     || ! "$venv/bin/python" -m pip install -q -e "$ROOT[dev]" $extra >>"$log" 2>&1; then
    echo "== $point: install failed (see $log)"
    "$python" - "$point" "$OUT/$point.json" <<'PY'
import json, sys, datetime
json.dump({"point": sys.argv[1], "date": datetime.date.today().isoformat(), "installed": False}, open(sys.argv[2], "w"), indent=2)
PY
    continue
  fi
  installed=$(date +%s)
  (cd "$ROOT" && "$venv/bin/python" -m pytest -n 2 -q -p no:cacheprovider tests/unit tests/parity) >>"$log" 2>&1
  tests_rc=$?
  tested=$(date +%s)
  (cd "$ROOT" && "$venv/bin/mcore-zoo" parity-report --arch all --no-layers --out "$OUT/$point.parity") >"$OUT/$point.parity.md" 2>>"$log"
  parity_rc=$?
  "$venv/bin/python" - "$point" "$OUT/$point.json" "$log" "$tests_rc" "$parity_rc" \
      "$((installed - start))" "$((tested - installed))" "$(( $(date +%s) - tested ))" <<'PY'
import datetime, json, platform, re, sys
from importlib.metadata import version
point, out, log, tests_rc, parity_rc, t_install, t_tests, t_parity = sys.argv[1:]
text = open(log).read()
summary = [l for l in text.splitlines() if re.search(r"\d+ (passed|failed)", l)]
counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary[-1])} if summary else {}
failed = sorted(set(re.findall(r"^FAILED (\S+)", text, re.M)))
versions = {p: version(p) for p in ("torch", "megatron-core", "transformers", "safetensors", "pluggy", "numpy")}
json.dump({"point": point, "date": datetime.date.today().isoformat(), "python": platform.python_version(),
           "versions": versions, "installed": True, "tests_exit": int(tests_rc), "tests": counts,
           "failed": failed, "parity_report_exit": int(parity_rc),
           "seconds": {"install": int(t_install), "tests": int(t_tests), "parity_report": int(t_parity)}},
          open(out, "w"), indent=2)
print(f"== {point}: tests exit {tests_rc} {counts}, parity-report --arch all exit {parity_rc}")
PY
done

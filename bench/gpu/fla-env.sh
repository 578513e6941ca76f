# Source on the GPU machine (project root) after bench/gpu/fla-setup.sh, for the runs that want
# flash-linear-attention: puts its install directory (FLA_SITE, default /tmp/fla-site) on PYTHONPATH.
# Sourced in a subshell by run_all.sh's hybrid-fla phase only: transformers picks fla up wherever it
# is importable (bench/gpu/hybrid_fla_parity.py keeps HF's reference on its torch path).
FLA_SITE=${FLA_SITE:-/tmp/fla-site}
[ -f "$FLA_SITE/.ready" ] || { echo "run: bash bench/gpu/fla-setup.sh WHEEL_DIR first (this machine is fresh)"; return 1 2>/dev/null || exit 1; }
export PYTHONPATH="$FLA_SITE:$(pwd)/src:$(pwd)${PYTHONPATH:+:$PYTHONPATH}"

# Source on the GPU machine (project root) after bench/gpu/fla-setup.sh, for the runs that want
# flash-linear-attention: puts its install directory (FLA_SITE, default /tmp/fla-site) on PYTHONPATH.
# Sourced in a subshell by run_all.sh's hybrid-fla phase only: transformers picks fla up wherever it
# is importable (bench/gpu/hybrid_fla_parity.py keeps HF's reference on its torch path).
FLA_SITE=${FLA_SITE:-/tmp/fla-site}
[ -f "$FLA_SITE/.ready" ] || { echo "run: bash bench/gpu/fla-setup.sh WHEEL_DIR first (this machine is fresh)"; return 1 2>/dev/null || exit 1; }
export PYTHONPATH="$FLA_SITE:$(pwd)/src:$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
# fla 0.6 runs some gated-delta-rule kernels on TileLang wherever `tilelang` is importable - vLLM 0.26
# depends on it, so it is on the path after vllm-env.sh - and on this image TileLang aborted the
# process ("libnvrtc symbols not found globally") or hung compiling: fla's Triton kernels (Triton
# >= 3.7.1 from FLA_SITE for the backward on Hopper) instead
export FLA_TILELANG=${FLA_TILELANG:-0}

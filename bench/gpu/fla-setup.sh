#!/usr/bin/env bash
# Runs ON the GPU machine, from the project root: installs flash-linear-attention (the `fla` package:
# the wheels flash-linear-attention and fla-core, pure Python with Triton kernels) into a directory of its
# own, put on PYTHONPATH only by the runs that want fla (bench/gpu/fla-env.sh); nothing of the image is
# replaced. transformers switches its own gated DeltaNet math to fla when fla is importable, so fla is
# never put on the path of the other phases.
#
#   bash bench/gpu/fla-setup.sh WHEEL_DIR [TARGET]      (TARGET default: /tmp/fla-site)
#
# WHEEL_DIR holds the wheels, fetched where an index is reachable with
#   pip download flash-linear-attention fla-core einops --no-deps -d WHEEL_DIR
# (einops is fla's one pure-Python dependency; torch and triton come with the image). Every wheel there
# is installed with pip --no-index --no-deps --target, except distributions the image already has.
# Then the zoo loads fla's kernels from TARGET (the setup fails, naming what is missing, if it cannot);
# tests/gpu/test_gated_deltanet_fla_gpu.py (the hybrid-fla phase) checks them against the torch path.
set -euo pipefail
wheels=${1:?usage: fla-setup.sh WHEEL_DIR [TARGET]}
target=${2:-/tmp/fla-site}
py=${PYTHON:-python3}
ls "$wheels"/flash_linear_attention-*.whl "$wheels"/fla_core-*.whl > /dev/null \
  || { echo "fla-setup: $wheels needs the flash_linear_attention and fla_core wheels"; exit 2; }
mkdir -p "$target"
install=()
for whl in "$wheels"/*.whl; do
  dist=$(basename "$whl"); dist=${dist%%-*}
  case $dist in flash_linear_attention|fla_core) install+=("$whl"); continue ;; esac
  if $py -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" 2>/dev/null; then
    echo "fla-setup: skip $dist (the image has it)"
  else
    install+=("$whl")
  fi
done
$py -m pip install --no-index --no-deps --target "$target" --upgrade "${install[@]}"
PYTHONPATH="$target:$(pwd)/src${PYTHONPATH:+:$PYTHONPATH}" $py -c \
  "from mcore_zoo.families.gated_deltanet.kernels import load_fla; k = load_fla(); print('fla', k.version, k.chunk_gated_delta_rule.__module__, k.causal_conv1d.__module__)"
echo "$target" > "$target/.ready"

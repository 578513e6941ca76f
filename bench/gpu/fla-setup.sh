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
# is installed with pip --no-index --no-deps --target, except distributions the image already has at the
# wheel's version or a newer one. A newer wheel (fla 0.6's backward on Hopper needs Triton >= 3.7.1:
#   pip download triton==3.7.1 --no-deps --only-binary=:all: --python-version 3.12 -d WHEEL_DIR)
# goes into TARGET too, so it shadows the image's copy for the runs that put TARGET on the path only.
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
  version=$(basename "$whl" | cut -d- -f2)
  if $py -c "
import importlib.metadata as m, sys
try:
    from packaging.version import Version
except ImportError:
    from pip._vendor.packaging.version import Version
sys.exit(0 if Version(m.version(sys.argv[1])) >= Version(sys.argv[2]) else 1)" "$dist" "$version" 2>/dev/null; then
    echo "fla-setup: skip $dist $version (the image has it, at this version or a newer one)"
  else
    install+=("$whl")
  fi
done
$py -m pip install --no-index --no-deps --target "$target" --upgrade "${install[@]}"
PYTHONPATH="$target:$(pwd)/src${PYTHONPATH:+:$PYTHONPATH}" $py -c \
  "from mcore_zoo.families.gated_deltanet.kernels import load_fla; k = load_fla(); print('fla', k.version, k.chunk_gated_delta_rule.__module__, k.causal_conv1d.__module__)"
echo "$target" > "$target/.ready"

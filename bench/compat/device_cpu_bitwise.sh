#!/usr/bin/env bash
# The bitwise CPU tests on another CPU kind: the GPU machine's host CPU, its GPUs hidden
# (CUDA_VISIBLE_DEVICES=""), Python 3.12, torch 2.11, megatron-core 0.19.2, transformers 5.17 - at
# torch's default thread count (the machine's cores) and at 1, 2 and 4 threads.
#
#   on the GPU machine, from the project root, with the megatron-core 0.19.2 (and psutil) py3.12
#   wheels in .gpu/cpu/:  bash bench/compat/device_cpu_bitwise.sh
#
# Prints the CPU model and one pytest summary per thread count; writes nothing into the repository.
set -uo pipefail
S=/tmp/site-cpu
python3 -m pip install -q --no-index --no-deps --no-compile --target "$S" .gpu/cpu/*.whl >/dev/null 2>&1 || true
export PYTHONPATH="$S:$(pwd)/src:$(pwd)" CUDA_VISIBLE_DEVICES="" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-200 | sed 's/Flags:.*\(avx512[a-z_0-9]*\).*/AVX512: yes/'
python3 -c "import torch, megatron.core, transformers; print('torch', torch.__version__, '| mcore', megatron.core.__version__, '| transformers', transformers.__version__, '| threads', torch.get_num_threads())"
TESTS=(tests/parity/test_moe_parity.py tests/parity/test_mla_parity.py tests/parity/test_mtp_parity.py
       tests/parity/test_grouped_experts.py tests/parity/test_mla_fp8.py tests/parity/test_moe_routing.py
       tests/parity/test_dense_parity.py "tests/parity/test_builtin_conformance.py::TestBuiltinConformance::test_parity"
       tests/unit/test_training_parts.py)
for threads in default 1 2 4; do
  if [ "$threads" = default ]; then unset OMP_NUM_THREADS; else export OMP_NUM_THREADS=$threads; fi
  echo "== OMP_NUM_THREADS=$threads"
  python3 -m pytest -p mcore_zoo.testing.plugin -q -p no:cacheprovider -o addopts="" "${TESTS[@]}" 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -15
done

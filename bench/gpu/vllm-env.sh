# Source on the GPU machine (project root) after bench/gpu/vllm-setup.sh: vLLM's wheels, then the
# Megatron-Core / TE environment of ../shared/gpu (if set up), then the project, on PYTHONPATH.
[ -f /tmp/vllm-wh/.ready ] || { echo "run: bash bench/gpu/vllm-setup.sh first (this machine is fresh)"; return 1 2>/dev/null || exit 1; }
if [ -f /tmp/gpu/.ready ] && [ -f .gpu/bin/device-env.sh ]; then source .gpu/bin/device-env.sh; fi
export PYTHONPATH="/tmp/vllm-site:$(pwd)/src:$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}  # in-process engine: GPU-to-GPU refit
export MCORE_ZOO_VLLM_PYTHON="$(pwd)/bench/gpu/vllm-python"  # parity-report --vllm
# vLLM 0.26 imports llguidance (guided decoding) at engine import; the index lacks its 1.7 release
PYTHONPATH="$PYTHONPATH" python3 -c "import llguidance" 2>/dev/null || export PYTHONPATH="$PYTHONPATH:$(pwd)/bench/gpu/stubs"

# Source on the GPU machine (project root) after STACK=sglang bench/gpu/vllm-setup.sh: SGLang's
# wheels (a site of their own, /tmp/sglang-site), then Megatron-Core / TE of ../shared/gpu (if set
# up), then the project, on PYTHONPATH. Not together with vllm-env.sh: their pins differ.
[ -f /tmp/sglang-wh/.ready ] || { echo "run: STACK=sglang bash bench/gpu/vllm-setup.sh first (this machine is fresh)"; return 1 2>/dev/null || exit 1; }
if [ -f /tmp/gpu/.ready ] && [ -f .gpu/bin/device-env.sh ]; then source .gpu/bin/device-env.sh; fi
export PYTHONPATH="/tmp/sglang-site:$(pwd)/src:$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# llguidance (a grammar backend) is imported at engine import; the index lacks the release SGLang pins
PYTHONPATH="$PYTHONPATH" python3 -c "import llguidance" 2>/dev/null || export PYTHONPATH="$PYTHONPATH:$(pwd)/bench/gpu/stubs"

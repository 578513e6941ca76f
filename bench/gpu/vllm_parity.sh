#!/usr/bin/env bash
# GPU parity with vLLM: for every built-in, vLLM bf16 (its own loaders, weights exported from the
# mcore model) vs mcore (te fast path; local hf-exact) vs transformers eager, per token, with
# exp|dlogp| (token_mult_prob_error). Run from the project root on the GPU machine after
#   bash bench/gpu/vllm-setup.sh && source bench/gpu/vllm-env.sh      (and ../shared/gpu for TE)
#   bash bench/gpu/vllm_parity.sh OUT      ->  OUT/te-vllm/, OUT/local-hf-exact-vllm/ (JSON, Markdown, HTML)
# Copy the Markdown reports to docs/parity/vllm-gpu/ to publish them.
#
# Models: random weights on published configs scaled with --scale small (8 layers, hidden <= 1024):
# the dense families' packaged configs (--arch), Qwen3-MoE / Mixtral / DeepSeek-V3 from
# VLLM_PARITY_CONFIGS (default ../shared/configs; on the GPU machine a carried copy), Qwen2-MoE /
# GLM-4.5-Air / DeepSeek-V2-Lite from bench/gpu/configs/ (their published shapes). MLA keeps
# kv_lora_rank 512 + rope 64 under --scale, the one shape vLLM's Hopper MLA kernels take.
# VLLM_PARITY_ARCHS: space-separated architectures (default: all ten); VLLM_PARITY_BACKENDS: "te
# local" (default both). Each architecture is one parity-report run (one vLLM engine).
set -uo pipefail
out=${1:?usage: vllm_parity.sh OUT}
mkdir -p "$out"
cfg=${VLLM_PARITY_CONFIGS:-../shared/configs}
here=bench/gpu/configs
declare -A model=(
  [LlamaForCausalLM]="--arch LlamaForCausalLM"
  [MistralForCausalLM]="--arch MistralForCausalLM"
  [Qwen2ForCausalLM]="--arch Qwen2ForCausalLM"
  [Qwen3ForCausalLM]="--arch Qwen3ForCausalLM"
  [Qwen3MoeForCausalLM]="--config $cfg/qwen3-30b-a3b.json --random-weights"
  [MixtralForCausalLM]="--config $cfg/mixtral-8x7b-v0.1.json --random-weights"
  [Qwen2MoeForCausalLM]="--config $here/qwen2-moe-a2.7b-shaped.json --random-weights"
  [Glm4MoeForCausalLM]="--config $here/glm-4.5-air-shaped.json --random-weights"
  [DeepseekV2ForCausalLM]="--config $here/deepseek-v2-lite-shaped.json --random-weights"
  [DeepseekV3ForCausalLM]="--config $cfg/deepseek-v3.json --random-weights"
)
archs=${VLLM_PARITY_ARCHS:-LlamaForCausalLM MistralForCausalLM Qwen2ForCausalLM Qwen3ForCausalLM Qwen3MoeForCausalLM MixtralForCausalLM Qwen2MoeForCausalLM Glm4MoeForCausalLM DeepseekV2ForCausalLM DeepseekV3ForCausalLM}
backends=" ${VLLM_PARITY_BACKENDS:-te local} "
status=0
for arch in $archs; do
  [ -n "${model[$arch]:-}" ] || { echo "unknown architecture $arch"; status=2; continue; }
  # shellcheck disable=SC2206  # the model arguments split on spaces
  report=(python3 -m mcore_zoo.cli parity-report ${model[$arch]} --dtype bfloat16 --device cuda --scale small -q --vllm)
  if [[ $backends == *" te "* ]]; then
    "${report[@]}" --backend te --out "$out/te-vllm" > "$out/te-vllm-$arch.log" 2>&1
    s=$?; echo "$arch te: exit $s"; (( s > status )) && status=$s
  fi
  if [[ $backends == *" local "* ]]; then
    CUBLAS_WORKSPACE_CONFIG=:0:0 "${report[@]}" --backend local --numerics hf-exact --out "$out/local-hf-exact-vllm" \
        > "$out/local-hf-exact-vllm-$arch.log" 2>&1
    s=$?; echo "$arch local hf-exact: exit $s"; (( s > status )) && status=$s
  fi
done
exit "$status"

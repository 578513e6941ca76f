#!/usr/bin/env bash
# GPU parity with vLLM: for every built-in, vLLM bf16 (its own loaders, weights exported from the
# mcore model) vs mcore (te fast path; local hf-exact) vs transformers eager, per token, with
# exp|dlogp| (token_mult_prob_error). Run from the project root on the GPU machine after
#   bash bench/gpu/vllm-setup.sh && source bench/gpu/vllm-env.sh      (and ../shared/gpu for TE)
#   bash bench/gpu/vllm_parity.sh OUT      ->  OUT/te-vllm/, OUT/local-hf-exact-vllm/ (JSON, Markdown, HTML)
# Copy the Markdown reports to docs/parity/vllm-gpu/ to publish them.
set -uo pipefail
out=${1:?usage: vllm_parity.sh OUT}
mkdir -p "$out"
# VLLM_PARITY_ARCHS: space-separated architectures (default: every built-in but the MLA family, whose
# vLLM kernels the lean wheelhouse leaves out); VLLM_PARITY_BACKENDS: "te local" (default both).
archs=()
for a in ${VLLM_PARITY_ARCHS:-LlamaForCausalLM MistralForCausalLM Qwen2ForCausalLM Qwen3ForCausalLM Qwen3MoeForCausalLM MixtralForCausalLM Qwen2MoeForCausalLM Glm4MoeForCausalLM}; do
  archs+=(--arch "$a")
done
report=(python3 -m mcore_zoo.cli parity-report "${archs[@]}" --dtype bfloat16 --device cuda --scale small -q --vllm)
backends=" ${VLLM_PARITY_BACKENDS:-te local} "
status=0
if [[ $backends == *" te "* ]]; then
  "${report[@]}" --backend te --out "$out/te-vllm" > "$out/te-vllm.log" 2>&1 || status=$?
  echo "te: exit $status"
fi
s2=0
if [[ $backends == *" local "* ]]; then
  CUBLAS_WORKSPACE_CONFIG=:0:0 "${report[@]}" --backend local --numerics hf-exact --out "$out/local-hf-exact-vllm" \
      > "$out/local-hf-exact-vllm.log" 2>&1 || s2=$?
  echo "local hf-exact: exit $s2"
fi
exit $(( status > s2 ? status : s2 ))

#!/usr/bin/env bash
# Every GPU measurement the docs cite, on one machine with 4 GPUs (fewer: phases serialise).
# Run from the repository root with megatron-core and Transformer Engine importable and
# PYTHONPATH=src (see ../shared/gpu/README.md):   bash bench/gpu/run_all.sh OUT [PHASE...]
# Phases: reports (parity-report jobs, one GPU each, in parallel), checks (GPU tests and the
# backend / profile grid), speed, multi (torchrun 2 / 4) - the default: all four; and on request
# training (log-prob head, train_step), profile (the training profile's distance and speed), refit
# and vllm (refit into vLLM, vLLM parity; need bench/gpu/vllm-setup.sh), fp8-rollout (bf16 and FP8
# vLLM engines vs a bf16 trainer per family, refit into the FP8 engine; vllm-setup.sh), vllm-exact (the vllm-exact
# profile against vLLM's batch-invariant mode; needs vllm-setup.sh too), seeds (the training
# profile at more seeds), moe-exact (hf-exact MoE vs transformers), moe-exact-packs (hf-exact MoE on mixed
# THD packs vs transformers on each sequence alone), moe-sites (the sites inside one hf-exact MoE block vs
# transformers' on the same input: the first differing op), grouped (TE grouped-GEMM experts)
# mla (DeepSeek-V3, te), profile-sdpa (hf-exact-sdpa on te: distance and speed), moe-speed (the profiles at
# Qwen3-30B-A3B's widths, sequential and grouped experts, both packs), exact-kernels (the training profile with
# norm_kernel / rope_kernel / swiglu_kernel = triton: their GPU tests and speed beside default and training, both packs) and two-gpu (refit
# at TP2, DeepSeek-V3 EP2 / TP2; 2 GPUs), hybrid-gpu (Qwen3-Next / Qwen3.5 / Qwen3.5-MoE at full width, 4
# layers: parity vs HF, hf-exact, THD vs BSHD speed of a gated DeltaNet layer, vLLM parity and refit;
# 4 GPUs in parallel, fewer serialise), hybrid-fla (the same models on te with the gated DeltaNet layer on
# flash-linear-attention's kernels vs HF eager on its torch path, fla's THD vs BSHD speed, the fla GPU
# test; needs bench/gpu/fla-setup.sh WHEEL_DIR; 4 GPUs in parallel), vllm-exact-tp2 (vllm-exact at TP2 against a TP2 engine;
# 2 GPUs), four-gpu (four-gpu-moe: Qwen3-30B-A3B and Mixtral-8x7B at EP2 / EP4 / TP2 x EP2 /
# PP2 x EP2; four-gpu-mla: DeepSeek-V3 at EP4 / TP2 x EP2; four-gpu-tp4: a Llama-3.1-8B-shaped
# model at TP4, te and local hf-exact; 4 GPUs), four-gpu-vllm (refit from TP4 into a TP4 vLLM engine,
# vllm-exact at TP4; 4 GPUs, vllm-setup.sh), layouts-4gpu (an actor, a reference and a critic at
# three layouts in one job against one GPU, the actor -> reference copy and offload of an 8B-shaped
# model against the measured copy bandwidths; 4 GPUs), load-gpu (an 8B-shaped checkpoint loaded onto one GPU and at
# TP2 against the read + copy floor; 2 GPUs),
# frontier-gpu (DeepSeek-V3.2, GLM-5 and gpt-oss-20b at full width,
# 2 layers, te bf16 vs HF eager; one report per GPU at a time), disagg (disaggregated refit: trainer and
# vLLM engine in separate processes, 8B-shaped dense and Qwen3-30B-A3B-shaped MoE; 2 GPUs, TP2 -> TP2
# too on 4; vllm-setup.sh), vl-gpu (Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE at full width, 4 decoder layers, images:
# parity vs HF, hf-exact with the pack vs each sequence alone, refit into vLLM; 4 GPUs in parallel, fewer share).
# RUN_GPU picks the GPU of the
# single-GPU on-request phases.
# Each job logs to OUT/logs/; a failing (or, past its time limit, killed) job is recorded and the
# others go on. Limits: JOB_TIMEOUT (single-GPU jobs, default 420 s), MULTI_TIMEOUT (torchrun jobs,
# default 240 s: a layout failing on some ranks only would otherwise wait for NCCL's timeout).
set -uo pipefail
out=${1:?usage: run_all.sh OUT [single|speed|multi]...}
shift
phases=${*:-reports checks speed multi}
phases=$(for p in $phases; do [[ $p == four-gpu ]] && echo four-gpu-moe four-gpu-mla four-gpu-tp4 || echo "$p"; done)
phases=$(echo $phases)  # one line, single spaces: the phase tests below match " name "
mkdir -p "$out/logs"
py=${PYTHON:-python3}
ngpu=$($py -c 'import torch; print(torch.cuda.device_count())')
nosplit=(env CUBLAS_WORKSPACE_CONFIG=:0:0 CUBLASLT_WORKSPACE_SIZE=0)
report=($py -m mcore_zoo.cli parity-report --dtype bfloat16 --device cuda --scale small -q -v)

job() {  # job NAME GPU CMD...: run on one GPU in the background, log, record the exit code
  local name=$1 gpu=$2
  shift 2
  ( CUDA_VISIBLE_DEVICES=$gpu timeout "${JOB_TIMEOUT:-420}" "$@" > "$out/logs/$name.log" 2>&1
    echo "$name exit $?" >> "$out/logs/status" ) &
}

# g I: the I-th GPU, round robin; within the GPUs CUDA_VISIBLE_DEVICES names, when set (two run_all.sh
# invocations may share one machine: CUDA_VISIBLE_DEVICES=0,1 ... & CUDA_VISIBLE_DEVICES=2,3 ... &)
cvd=${CUDA_VISIBLE_DEVICES:-}; visible=(${cvd//,/ })
g() {  # (no GPU - a CPU dry run of a phase - counts as one)
  local n=$(( ngpu > 0 ? ngpu : 1 ))
  if (( ${#visible[@]} )); then echo "${visible[$(( $1 % n ))]}"; else echo $(( $1 % n )); fi
}
if [[ " $phases " == *" reports "* ]]; then
  # te (the fast path) vs HF eager for every architecture: B=4 x 512, invariance matrix, ablation
  job te-bf16 "$(g 0)" "${report[@]}" --arch all --backend te --lengths 512,512,512,512 --invariance --ablation \
      --out "$out/parity/te-bf16"
  # hf-exact (eager) on local: bitwise vs HF eager, equal and mixed lengths (split-K off), ablation
  job local-bitwise "$(g 1)" "${nosplit[@]}" "${report[@]}" --arch all --backend local --bitwise \
      --lengths 512,512,512,512,300,100,37 --invariance --ablation --out "$out/parity/local-bf16-bitwise"
  # hf-exact-sdpa on portable vs HF sdpa
  job portable-sdpa-bitwise "$(g 2)" "${nosplit[@]}" "${report[@]}" --arch all --backend portable --bitwise \
      --reference sdpa --lengths 512,512,512,512,300,100,37 --out "$out/parity/portable-sdpa-bf16-bitwise"
  # portable (default kernel: torch varlen_attn) vs HF eager
  job portable-bf16 "$(g 3)" "${report[@]}" --arch all --backend portable --lengths 512,512,512,512,300,100,37 \
      --invariance --out "$out/parity/portable-bf16"
  wait
  if (( ngpu >= 2 )); then
    CUDA_VISIBLE_DEVICES=0,1 timeout "${JOB_TIMEOUT:-420}" "${report[@]}" --arch LlamaForCausalLM --backend te \
        --invariance-tp 2 --lengths 512,300,100,37 --out "$out/parity/te-bf16-tp2" > "$out/logs/te-tp2.log" 2>&1
    echo "te-bf16-tp2 exit $?" >> "$out/logs/status"
  fi
fi

if [[ " $phases " == *" checks "* ]]; then
  # asserting GPU tests, then the full backend / profile / ablation grid
  job gpu-tests "$(g 3)" bash -c "$py -m pytest tests/gpu -q -p no:cacheprovider && \
      $py bench/gpu/dense_numerics.py --out $out/dense && \
      ${nosplit[*]} $py bench/gpu/dense_numerics.py --out $out/dense --tag nosplitk --only hf-exact"
  wait
fi

if [[ " $phases " == *" speed "* ]]; then
  CUDA_VISIBLE_DEVICES=0 timeout "${JOB_TIMEOUT:-420}" $py bench/gpu/numerics_speed.py --out "$out/speed" \
      > "$out/logs/speed.log" 2>&1
  echo "speed exit $?" >> "$out/logs/status"
fi

if [[ " $phases " == *" multi "* ]] && (( ngpu >= 2 )); then
  tr() { local n=$1; shift; timeout "${MULTI_TIMEOUT:-240}" $py -m torch.distributed.run --standalone --nproc_per_node "$n" "$@"; }
  tr 2 bench/gpu/parallel_parity.py --out "$out/parallel-2gpu" > "$out/logs/parallel-2gpu.log" 2>&1
  echo "parallel-2gpu exit $?" >> "$out/logs/status"
  tr 2 bench/gpu/parallel_parity.py --backend local --numerics hf-exact --layouts tp2,pp2 \
      --out "$out/parallel-2gpu-hf-exact" > "$out/logs/parallel-2gpu-hf-exact.log" 2>&1
  echo "parallel-2gpu-hf-exact exit $?" >> "$out/logs/status"
  if (( ngpu >= 4 )); then
    tr 4 bench/gpu/parallel_parity.py --out "$out/parallel-4gpu" > "$out/logs/parallel-4gpu.log" 2>&1
    echo "parallel-4gpu exit $?" >> "$out/logs/status"
  fi
fi
mkdir -p "$out/training" "$out/rollout" "$out/parity"
run() {  # run NAME TIMEOUT CMD...: in the foreground on GPU $RUN_GPU (default 0), log, record the exit code
  local name=$1 limit=$2
  shift 2
  CUDA_VISIBLE_DEVICES=${RUN_GPU:-0} timeout "$limit" "$@" > "$out/logs/$name.log" 2>&1
  echo "$name exit $?" >> "$out/logs/status"
}
dense=(--arch LlamaForCausalLM --arch MistralForCausalLM --arch Qwen2ForCausalLM --arch Qwen3ForCausalLM)

if [[ " $phases " == *" training "* ]]; then
  # the log-prob head (Triton kernels and torch path) and the training step against GPTModel's labels path
  run head-tests 300 $py -m pytest tests/gpu/test_logprob_head_gpu.py -q -p no:cacheprovider
  run head-bench 300 $py bench/logprob_head.py --device cuda --tokens 8192 --vocab 151936 --repeat 5 \
      --json "$out/training/logprob_head.json"
  run train-step 420 $py bench/gpu/train_step_bench.py --out "$out/training/default"
  run train-step-training 300 $py bench/gpu/train_step_bench.py --profile training --tokens 8192 \
      --out "$out/training/training"
fi

if [[ " $phases " == *" profile "* ]]; then
  # the training profile's distance to HF eager next to HF's own sdpa-vs-eager spread, every dense
  # built-in (8 layers, published width up to 1024), with the ablation from it; the variant on
  # Transformer Engine's fused attention; their speed
  run parity-training 420 "${report[@]}" "${dense[@]}" --backend te --numerics training \
      --lengths 512,512,512,512 --ablation --out "$out/parity/te-training"
  run parity-training-te-attention 420 "${report[@]}" "${dense[@]}" --backend te --numerics training \
      --knob attention=backend --knob linear_bias=separate --lengths 512,512,512,512 \
      --out "$out/parity/te-training-te-attention"
  run profile-speed 420 $py bench/gpu/numerics_speed.py --no-gemm --out "$out/training/speed" \
      --variant te/default=te:default --variant te/training=te:training \
      --variant "te/training, TE attention=te:training,attention=backend,linear_bias=separate" \
      --variant te/hf-exact=te:hf-exact
fi

if [[ " $phases " == *" refit "* ]]; then
  # needs bench/gpu/vllm-setup.sh and vllm-env.sh: refit exactness, then refit speed
  run refit-tests 420 $py -m pytest -p mcore_zoo.testing.plugin tests/gpu/test_refit_gpu.py -q -s -p no:cacheprovider
  run refit-bench 240 $py bench/gpu/refit_bench.py --out "$out/rollout/refit-tp1.json"
fi

if [[ " $phases " == *" fp8-rollout "* ]]; then
  # needs vllm-setup.sh and vllm-env.sh: FP8 rollout from bf16 training per family (Llama 8B, Qwen3-30B-A3B,
  # DeepSeek-V3 shapes, layers / experts cut): bf16 and FP8 engines vs the trainer, refit into FP8 bitwise
  run fp8-rollout "${FP8_ROLLOUT_TIMEOUT:-2400}" $py bench/gpu/fp8_rollout.py --out "$out/rollout/fp8"
fi

if [[ " $phases " == *" vllm "* ]]; then
  # vLLM bf16 vs mcore vs HF eager per token, every built-in (vllm_parity.sh)
  run vllm-parity 560 bash bench/gpu/vllm_parity.sh "$out/parity/vllm"
fi

if [[ " $phases " == *" mla "* ]]; then
  # DeepSeek-V3 at full width, 2 layers (one dense, one MoE with 64 of its 256 experts), te bf16
  run mla-te 540 $py -m mcore_zoo.cli parity-report --dtype bfloat16 --device cuda -q -v --config "${MLA_CONFIG:-.gpu/cfg/deepseek-v3.json}" --random-weights \
      --set num_hidden_layers=2 --set first_k_dense_replace=1 --set n_routed_experts=64 --backend te \
      --lengths 512,512,300,100 --out "$out/parity/mla-te"
fi
if [[ " $phases " == *" vllm-exact "* ]]; then
  # needs vllm-setup.sh: trainer log-probs bitwise vs vLLM batch-invariant mode, then the speed
  mkdir -p "$out/rollout/vllm-exact"
  MCORE_ZOO_GPU_RESULTS="$out/rollout/vllm-exact" run vllm-exact 540 $py -m pytest -p mcore_zoo.testing.plugin tests/gpu/test_vllm_exact_gpu.py \
      -q -s -p no:cacheprovider
fi
if [[ " $phases " == *" grouped "* ]]; then
  # Transformer Engine grouped-GEMM experts (numerics knob grouped_experts) against the sequential ones
  run grouped-experts 420 $py -m pytest -p mcore_zoo.testing.plugin tests/gpu/test_grouped_experts_gpu.py -q -s \
      -p no:cacheprovider
fi
if [[ " $phases " == *" vllm-exact-speed "* ]]; then
  mkdir -p "$out/rollout/vllm-exact"
  VLLM_BATCH_INVARIANT=1 run vllm-exact-speed 240 bash -c "$py tests/gpu/test_vllm_exact_gpu.py speed \
      LlamaForCausalLM /tmp/vx-speed > $out/rollout/vllm-exact/speed.json"
fi

if [[ " $phases " == *" profile-sdpa "* ]]; then
  # hf-exact-sdpa on te (TE GEMMs, HF's norms / RoPE / SwiGLU / biases, attention as HF's sdpa calls
  # it, one call per sequence; the training profile's knobs): its distance to HF eager against HF
  # sdpa's, and bitwise against HF sdpa on each sequence of a mixed pack (split-K off); torch's varlen flash kernel (one
  # call per pack) in its place. Then their training speed (the measurements behind `training`).
  run parity-hf-exact-sdpa 300 "${report[@]}" "${dense[@]}" --backend te --numerics hf-exact-sdpa \
      --lengths 512,512,512,512 --out "$out/parity/te-hf-exact-sdpa"
  variants=(--variant te/default=te:default --variant te/training=te:training --variant te/hf-exact-sdpa=te:hf-exact-sdpa
            --variant "te/training, varlen attention=te:training,attention=varlen,linear_bias=fused")
  run profile-sdpa-speed 300 $py bench/gpu/numerics_speed.py --no-gemm --out "$out/training/speed-sdpa" "${variants[@]}"
  run parity-hf-exact-sdpa-bitwise 300 "${nosplit[@]}" "${report[@]}" "${dense[@]}" --backend te --numerics hf-exact-sdpa \
      --reference sdpa --bitwise --no-baseline --lengths 512,512,512,300,100,37 --out "$out/parity/te-hf-exact-sdpa-vs-sdpa"
  run parity-training-varlen 300 "${report[@]}" "${dense[@]}" --backend te --numerics training \
      --knob attention=varlen --knob linear_bias=fused --lengths 512,512,512,512 --out "$out/parity/te-training-varlen"
  run profile-sdpa-speed-16x512 300 $py bench/gpu/numerics_speed.py --no-gemm --batch 16 --seq 512 \
      --out "$out/training/speed-sdpa-16x512" "${variants[@]}"
fi

if [[ " $phases " == *" exact-kernels "* ]]; then
  # HF-order RMSNorm, Megatron-Core's unfused RoPE and SwiGLU through Triton (mcore_zoo.kernels.hf_rmsnorm / rope /
  # swiglu): bitwise forward (and RoPE's and SwiGLU's gradients), the training profile's logits kept; then the time of
  # training with them beside default and training (docs/numerics.md, "Where the 1.30x goes")
  run exact-kernels-test 420 $py -m pytest -q -s -p no:cacheprovider tests/gpu/test_hf_rmsnorm_gpu.py tests/gpu/test_rope_kernel_gpu.py \
      tests/gpu/test_swiglu_kernel_gpu.py tests/gpu/test_exact_kernels_gpu.py
  ekv=(--variant te/default=te:default --variant te/training=te:training
       --variant "te/training, triton norm=te:training,norm_kernel=triton"
       --variant "te/training, triton rope=te:training,rope_kernel=triton"
       --variant "te/training, triton swiglu=te:training,swiglu_kernel=triton"
       --variant "te/training, triton norm + rope + swiglu=te:training,norm_kernel=triton,rope_kernel=triton,swiglu_kernel=triton")
  run exact-kernels-speed-4x2048 300 $py bench/gpu/numerics_speed.py --no-gemm --profile --out "$out/training/exact-kernels-4x2048" "${ekv[@]}"
  run exact-kernels-speed-16x512 300 $py bench/gpu/numerics_speed.py --no-gemm --profile --batch 16 --seq 512 \
      --out "$out/training/exact-kernels-16x512" "${ekv[@]}"
fi

if [[ " $phases " == *" moe-speed "* ]]; then
  # the numerics profiles at Qwen3-30B-A3B's widths (4 layers, 128 experts of 768, top-8), sequential and
  # grouped-GEMM experts, THD packs of 4 x 2048 and 16 x 512 tokens, next to transformers (docs/numerics.md)
  moev=(--variant te/default=te:default --variant "te/default, grouped experts=te:default,grouped_experts=true"
        --variant te/training=te:training --variant "te/training, grouped experts=te:training,grouped_experts=true"
        --variant te/hf-exact=te:hf-exact --variant local/hf-exact=local:hf-exact)
  run moe-speed-4x2048 600 $py bench/gpu/numerics_speed.py --no-gemm --shape qwen3-30b-a3b --out "$out/training/moe-speed-4x2048" "${moev[@]}"
  run moe-speed-16x512 600 $py bench/gpu/numerics_speed.py --no-gemm --shape qwen3-30b-a3b --batch 16 --seq 512 \
      --out "$out/training/moe-speed-16x512" "${moev[@]}"
fi

if [[ " $phases " == *" two-gpu "* ]] && (( ngpu >= 2 )); then
  tr() { local n=$1; shift; timeout "${MULTI_TIMEOUT:-240}" $py -m torch.distributed.run --standalone --nproc_per_node "$n" "$@"; }
  # refit at TP2 into a TP2 engine (needs vllm-setup.sh), then DeepSeek-V3 (MLA) EP2 / TP2 vs one GPU
  tr 2 bench/gpu/refit_bench.py --tp 2 --backend te --out "$out/rollout/refit-tp2.json" > "$out/logs/refit-tp2.log" 2>&1
  echo "refit-tp2 exit $?" >> "$out/logs/status"
  MULTI_TIMEOUT=${MLA_TIMEOUT:-420} tr 2 bench/gpu/parallel_parity.py --config "${MLA_CONFIG:-.gpu/cfg/deepseek-v3.json}" --layers 2 \
      --set n_routed_experts=64 --layouts ep2,tp2 --out "$out/parallel-2gpu-mla" > "$out/logs/mla-ep2.log" 2>&1
  echo "mla-ep2 exit $?" >> "$out/logs/status"
fi

if [[ " $phases " == *" vllm-exact-tp2 "* ]] && (( ngpu >= 2 )); then
  # vllm-exact at TP2 against a TP2 engine in batch-invariant mode (needs vllm-setup.sh), one engine per process
  tr() { local n=$1; shift; timeout "${MULTI_TIMEOUT:-240}" $py -m torch.distributed.run --standalone --nproc_per_node "$n" "$@"; }
  mkdir -p "$out/vllm-exact-tp2"
  for arch in ${TP2_ARCHS:-LlamaForCausalLM Qwen2ForCausalLM Qwen3ForCausalLM MistralForCausalLM}; do
    # the single-GPU run first: its pack and gradients are the TP2 run's gradient reference
    grads="$out/vllm-exact-tp2/tp1-$arch-grads.safetensors"; rm -f "$grads"
    timeout "${JOB_TIMEOUT:-420}" $py bench/gpu/vllm_exact_tp.py --tp 1 --arch "$arch" --grads "$grads" \
        --out "$out/vllm-exact-tp2/tp1-$arch.json" > "$out/logs/vllm-exact-tp1-$arch.log" 2>&1
    echo "vllm-exact-tp1-$arch exit $?" >> "$out/logs/status"
    tr 2 bench/gpu/vllm_exact_tp.py --arch "$arch" --grads "$grads" --out "$out/vllm-exact-tp2/$arch.json" > "$out/logs/vllm-exact-tp2-$arch.log" 2>&1
    echo "vllm-exact-tp2-$arch exit $?" >> "$out/logs/status"
  done
  # Qwen3-MoE: TP1 (gradient reference), TP2 (experts split by intermediate rows) and TP2 x EP2
  # (the engine with enable_expert_parallel=True, the trainer at expert-TP 1)
  arch=Qwen3MoeForCausalLM
  grads="$out/vllm-exact-tp2/tp1-$arch-grads.safetensors"; rm -f "$grads"
  timeout "${JOB_TIMEOUT:-420}" $py bench/gpu/vllm_exact_tp.py --tp 1 --arch "$arch" --grads "$grads" \
      --out "$out/vllm-exact-tp2/tp1-$arch.json" > "$out/logs/vllm-exact-tp1-$arch.log" 2>&1
  echo "vllm-exact-tp1-$arch exit $?" >> "$out/logs/status"
  for ep in 1 2; do
    tr 2 bench/gpu/vllm_exact_tp.py --arch "$arch" --ep "$ep" --grads "$grads" --out "$out/vllm-exact-tp2/$arch-ep$ep.json" \
        > "$out/logs/vllm-exact-tp2-ep$ep-$arch.log" 2>&1
    echo "vllm-exact-tp2-ep$ep-$arch exit $?" >> "$out/logs/status"
  done
fi

if (( ngpu >= 4 )); then
  tr() { local n=$1; shift; timeout "${MULTI_TIMEOUT:-240}" $py -m torch.distributed.run --standalone --nproc_per_node "$n" "$@"; }
  # published configs at full width, 2 layers, te bf16, each layout vs the same model on one GPU,
  # with the export (bitwise) and every rank's reads (an EP rank reads only its own experts)
  if [[ " $phases " == *" four-gpu-moe "* ]]; then
    for cfg in ${FOUR_GPU_MOE_CONFIGS:-qwen3-30b-a3b mixtral-8x7b-v0.1}; do
      MULTI_TIMEOUT=${MOE_TIMEOUT:-300} tr 4 bench/gpu/parallel_parity.py --config ".gpu/cfg/$cfg.json" --layers 2 \
          --layouts ep2,ep4,tp2-sp-ep2,pp2-ep2 --out "$out/four-gpu-$cfg" > "$out/logs/four-gpu-$cfg.log" 2>&1
      echo "four-gpu-$cfg exit $?" >> "$out/logs/status"
    done
  fi
  if [[ " $phases " == *" four-gpu-mla "* ]]; then
    # DeepSeek-V3 (MLA): one dense and one MoE layer, 64 of its 256 routed experts
    MULTI_TIMEOUT=${MLA_TIMEOUT:-420} tr 4 bench/gpu/parallel_parity.py --config "${MLA_CONFIG:-.gpu/cfg/deepseek-v3.json}" \
        --layers 2 --set n_routed_experts=64 --layouts ep4,tp2-sp-ep2 --out "$out/four-gpu-mla" > "$out/logs/four-gpu-mla.log" 2>&1
    echo "four-gpu-mla exit $?" >> "$out/logs/status"
  fi
  if [[ " $phases " == *" four-gpu-tp4 "* ]]; then
    # Llama-3.1-8B's width (hidden 4096, 32/8 heads, vocab 128256), TP4_LAYERS of its 32 layers
    llama=(--config "${TP4_CONFIG:-.gpu/cfg/llama-3.1-8b.json}" --layers "${TP4_LAYERS:-8}" --layouts tp4)
    tr 4 bench/gpu/parallel_parity.py "${llama[@]}" --out "$out/four-gpu-tp4-te" > "$out/logs/four-gpu-tp4-te.log" 2>&1
    echo "four-gpu-tp4-te exit $?" >> "$out/logs/status"
    tr 4 bench/gpu/parallel_parity.py "${llama[@]}" --backend local --numerics hf-exact \
        --out "$out/four-gpu-tp4-hf-exact" > "$out/logs/four-gpu-tp4-hf-exact.log" 2>&1
    echo "four-gpu-tp4-hf-exact exit $?" >> "$out/logs/status"
  fi
fi

if [[ " $phases " == *" disagg "* ]] && (( ngpu >= 2 )); then
  # needs vllm-setup.sh: disaggregated refit, trainer on GPU g0 and a vLLM engine in its own process on
  # g1 (8B-shaped dense, all 32 layers; Qwen3-30B-A3B-shaped MoE, 12 layers), next to NCCL's own
  # broadcast bandwidth on the same link; with 4 GPUs also trainer TP2 (g0, g1) -> engine TP2 (g2, g3)
  tps=(--tp 1); (( ngpu >= 4 )) && tps=(--tp 1 --tp 2)
  gpus=$(g 0),$(g 1); (( ngpu >= 4 )) && gpus=$(g 0),$(g 1),$(g 2),$(g 3)
  # (one more refit per case under torch's profiler on both sides: where a bucket's time goes)
  CUDA_VISIBLE_DEVICES=$gpus timeout "${DISAGG_TIMEOUT:-1500}" $py bench/gpu/disagg_refit_bench.py "${tps[@]}" \
      --trace --out "$out/rollout/disagg" > "$out/logs/disagg.log" 2>&1
  echo "disagg exit $?" >> "$out/logs/status"
fi

if [[ " $phases " == *" four-gpu-vllm "* ]] && (( ngpu >= 4 )); then
  # needs vllm-setup.sh: refit of the 8B shape (Llama-3-8B widths, 32 layers) from a TP4 trainer into a
  # TP4 engine (one engine rank per trainer rank), then vllm-exact at TP4 against a TP4 engine in
  # batch-invariant mode (four key-value heads; the one-GPU run of the same model first: its gradients
  # are the TP4 run's reference)
  tr() { local n=$1; shift; timeout "${MULTI_TIMEOUT:-240}" $py -m torch.distributed.run --standalone --nproc_per_node "$n" "$@"; }
  # REFIT_TIMEOUT: the engine's start dominates (97 s at TP4 on a fresh machine, its first kernel
  # compiles; the refits themselves a few seconds), so 150 s stops a cold run in its exactness check
  MULTI_TIMEOUT=${REFIT_TIMEOUT:-300} tr 4 bench/gpu/refit_bench.py --tp 4 --backend te --layers 32 \
      --out "$out/rollout/refit-tp4.json" > "$out/logs/refit-tp4.log" 2>&1
  echo "refit-tp4 exit $?" >> "$out/logs/status"
  mkdir -p "$out/vllm-exact-tp4"
  # the zoo's row-parallel sum (NCCL's tree order) against NCCL's all-reduce as vLLM's batch-invariant
  # mode configures it (tree, Simple, one channel), bit for bit on four GPUs; no vLLM needed
  timeout "${JOB_TIMEOUT:-420}" $py -m pytest -q -s -p no:cacheprovider tests/gpu/test_chain_all_reduce_gpu.py \
      > "$out/logs/chain-all-reduce-tp4.log" 2>&1
  echo "chain-all-reduce-tp4 exit $?" >> "$out/logs/status"
  for arch in ${TP4_ARCHS:-LlamaForCausalLM Qwen3ForCausalLM}; do
    grads="$out/vllm-exact-tp4/tp1-$arch-grads.safetensors"; rm -f "$grads"
    timeout "${JOB_TIMEOUT:-420}" $py bench/gpu/vllm_exact_tp.py --tp 1 --kv-heads 4 --arch "$arch" --grads "$grads" \
        --out "$out/vllm-exact-tp4/tp1-$arch.json" > "$out/logs/vllm-exact-tp4-ref-$arch.log" 2>&1
    echo "vllm-exact-tp4-ref-$arch exit $?" >> "$out/logs/status"
    # NCCL's INFO lines name each communicator's tree ("Trees [0] ..."): the chain the engine adds along
    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT tr 4 bench/gpu/vllm_exact_tp.py --tp 4 --kv-heads 4 --arch "$arch" --grads "$grads" \
        --out "$out/vllm-exact-tp4/$arch.json" > "$out/logs/vllm-exact-tp4-$arch.log" 2>&1
    echo "vllm-exact-tp4-$arch exit $?" >> "$out/logs/status"
  done
fi

if [[ " $phases " == *" layouts-4gpu "* ]] && (( ngpu >= 4 )); then
  # several models at several layouts in one job (actor TP2 x PP2, reference TP1 x DP4, critic
  # PP2 x DP2; a policy copy on two of the ranks), bf16 over NCCL, against the same models on one
  # GPU; then the reference bandwidths and
  # the actor -> reference copy and offload of an 8B-shaped model (LAYOUTS_COPY_LAYERS of its 32 layers)
  tr() { local n=$1; shift; timeout "${MULTI_TIMEOUT:-240}" $py -m torch.distributed.run --standalone --nproc_per_node "$n" "$@"; }
  MULTI_TIMEOUT=${LAYOUTS_JOB_TIMEOUT:-180} tr 4 bench/gpu/layouts_job.py --parts job,part-of-job \
      --out "$out/layouts-4gpu/job" > "$out/logs/layouts-4gpu-job.log" 2>&1
  echo "layouts-4gpu-job exit $?" >> "$out/logs/status"
  MULTI_TIMEOUT=${LAYOUTS_COPY_TIMEOUT:-180} tr 4 bench/gpu/layouts_job.py --parts bandwidth,copy-8b \
      --copy-layers "${LAYOUTS_COPY_LAYERS:-32}" --out "$out/layouts-4gpu/copy-8b" > "$out/logs/layouts-4gpu-copy.log" 2>&1
  echo "layouts-4gpu-copy exit $?" >> "$out/logs/status"
fi

if [[ " $phases " == *" seeds "* ]]; then
  # the training profile's distance to HF eager next to HF sdpa's, two more weight / token seeds
  for seed in ${SEEDS:-1 2}; do
    run "parity-training-seed$seed" 300 "${report[@]}" "${dense[@]}" --backend te --numerics training \
        --lengths 512,512,512,512 --seed "$seed" --out "$out/parity/te-training-seed$seed"
  done
fi

if [[ " $phases " == *" moe-exact "* ]]; then
  # hf-exact MoE on local (split-K off) vs transformers, with each of its two experts implementations
  moe=(--config "${MOE_CONFIG:-.gpu/cfg/qwen3-30b-a3b.json}" --random-weights --set num_hidden_layers=2 --backend local
       --numerics hf-exact --bitwise --lengths 512,512,512,512 --seq-format bshd)
  run moe-exact-grouped 300 "${nosplit[@]}" $py -m mcore_zoo.cli parity-report --dtype bfloat16 --device cuda -q -v \
      "${moe[@]}" --out "$out/parity/moe-hf-exact-grouped_mm"
  run moe-exact-eager 300 "${nosplit[@]}" $py -m mcore_zoo.cli parity-report --dtype bfloat16 --device cuda -q -v \
      "${moe[@]}" --knob moe_experts=eager --out "$out/parity/moe-hf-exact-eager"
fi

if [[ " $phases " == *" moe-exact-packs "* ]]; then
  # hf-exact MoE on local (split-K off) on mixed THD packs (512, 300, 100, 37 and 16 x 64) at the full
  # width of Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3 (64 of the 256 routed experts), Qwen3-235B-A22B, Mixtral-8x22B
  # and Kimi-K2 (64 of the 384 routed experts), 2 layers, bf16:
  # each sequence packed and alone against transformers (grouped_mm and eager experts) on it alone,
  # bit for bit, first divergent site and max |dlogit| where not (bench/gpu/moe_exact_packs.py; one
  # report per model). The CPU dry run: MOE_PACKS_ARGS="--device cpu --tiny"
  for m in qwen3-30b-a3b mixtral-8x7b deepseek-v3 qwen3-235b-a22b mixtral-8x22b kimi-k2; do
    run "moe-exact-packs-$m" "${MOE_PACKS_TIMEOUT:-600}" "${nosplit[@]}" $py bench/gpu/moe_exact_packs.py --models "$m" \
        --out "$out/moe-exact-packs/$m" ${MOE_PACKS_ARGS:-}
  done
fi

if [[ " $phases " == *" moe-sites "* ]]; then
  # where one MoE block of hf-exact (local, split-K off) departs from transformers: layer 0's block fed
  # transformers' own block input (512, 300, 100, 37 tokens each alone and as a THD pack; a 4 x 512 BSHD
  # batch), every site inside it compared (router logits, routing, each expert's rows, shared expert and
  # its gate, combine, block output) with the GEMM shapes each side ran, the first differing GEMM re-run
  # alone both ways; both experts implementations (bench/gpu/moe_block_sites.py; one report per model
  # under $out/moe-sites/). Full width, 1 decoder layer, the vocabulary cut to 32000 (the block does not
  # see it; the random weights are drawn on the CPU); Qwen3-Next with 64 and DeepSeek-V3 with 32 routed
  # experts. The CPU dry run: MOE_SITES_ARGS="--device cpu --scale tiny --lengths 13,7,3 --batch 2x5"
  ms=($py bench/gpu/moe_block_sites.py --experts grouped_mm,eager --set num_hidden_layers=1 --set vocab_size=32000
      --out "$out/moe-sites")
  cfgs=tests/fixtures/configs
  run moe-sites-qwen3-next "${MOE_SITES_TIMEOUT:-240}" "${nosplit[@]}" "${ms[@]}" --config "$cfgs/qwen3-next-80b-a3b.json" \
      --set num_experts=64 ${MOE_SITES_ARGS:-}
  run moe-sites-qwen3-30b-a3b "${MOE_SITES_TIMEOUT:-240}" "${nosplit[@]}" "${ms[@]}" --config "$cfgs/qwen3-30b-a3b.json" \
      ${MOE_SITES_ARGS:-}
  run moe-sites-mixtral-8x7b "${MOE_SITES_TIMEOUT:-240}" "${nosplit[@]}" "${ms[@]}" --config "$cfgs/mixtral-8x7b-v0.1.json" \
      ${MOE_SITES_ARGS:-}
  run moe-sites-deepseek-v3 "${MOE_SITES_TIMEOUT:-240}" "${nosplit[@]}" "${ms[@]}" --config "$cfgs/deepseek-v3.json" \
      --set first_k_dense_replace=0 --set n_routed_experts=32 ${MOE_SITES_ARGS:-}
fi

if [[ " $phases " == *" load-gpu "* ]]; then
  # an HF checkpoint of Llama-3.1-8B's shape (16 GB bf16, written once under LOAD_GPU_CKPT) loaded
  # onto one GPU and at TP2 (2 GPUs) against the read + host-to-device copy floor, 2 alternated
  # rounds, each measurement a fresh process (bench/gpu/load_gpu.py); about 4 + 3 minutes. The CPU dry
  # run of the same phase: LOAD_GPU_ARGS="--device cpu --tiny"
  gpus=$(g 0); (( ngpu >= 2 )) && gpus=$(g 0),$(g 1)
  # the staging ring's default (4 x 16 MiB, three in flight, 8 read threads of its own, raw copies), the same
  # with every region copied through torch (:c, staging.RAW_COPIES off) and with 4 read threads, each load
  # against the same floor (read on 8 threads) in every round; the first round's loads also timed step by
  # step on their main thread (--breakdown)
  rings=(--ring default --ring default:c --ring default:r4 --breakdown)
  CUDA_VISIBLE_DEVICES=$gpus timeout "${LOAD_GPU_TIMEOUT:-600}" $py bench/gpu/load_gpu.py --out "$out/load-gpu" --rounds 2 \
      "${rings[@]}" ${LOAD_GPU_CKPT:+--ckpt "$LOAD_GPU_CKPT"} ${LOAD_GPU_ARGS:-} > "$out/logs/load-gpu.log" 2>&1
  echo "load-gpu exit $?" >> "$out/logs/status"
  # a Qwen3-30B-A3B-shaped MoE checkpoint (4 layers, 1 536 expert tensors) at EP1 / EP2
  CUDA_VISIBLE_DEVICES=$gpus timeout "${LOAD_GPU_TIMEOUT:-600}" $py bench/gpu/load_gpu.py --shape qwen3-30b-a3b --rounds 2 \
      "${rings[@]}" --out "$out/load-gpu-moe" ${LOAD_GPU_ARGS:-} > "$out/logs/load-gpu-moe.log" 2>&1
  echo "load-gpu-moe exit $?" >> "$out/logs/status"
fi

if [[ " $phases " == *" frontier-gpu "* ]]; then
  # DeepSeek-V3.2 and GLM-5 (DeepSeek sparse attention) and gpt-oss-20b (attention sinks, sliding windows):
  # published configs at full width, 2 layers (DSA: one dense, one MoE layer with 32 of the 256 routed
  # experts; gpt-oss: one sliding and one full layer, all 32 experts), random weights, bf16; te (TE linears
  # and norms around the zoo's sparse / sink core attention; not declared by the plugins yet, so
  # frontier_parity.py admits it for this run) vs HF eager with HF's own sdpa-vs-eager row. A te run that
  # writes no report (build or runtime error) is followed by the same report on local.
  frdir="$out/parity/gpu-frontier"
  fr=($py bench/gpu/frontier_parity.py --admit te -- --dtype bfloat16 --device cuda -q -v --random-weights)
  # DSA with the ablation (each numerics knob flipped alone): on the CPU in bf16 the norm order decides
  # the indexer's selection near ties, and norm=hf brings default to HF sdpa's own distance
  dsa=(--set num_hidden_layers=2 --set first_k_dense_replace=1 --ablation)
  frontier() {  # frontier NAME GPU ARGS...: te on one GPU in the background; local when te wrote no report
    local name=$1 gpu=$2
    shift 2
    ( CUDA_VISIBLE_DEVICES=$gpu timeout "${JOB_TIMEOUT:-420}" "${fr[@]}" "$@" --backend te --name "$name" \
          --out "$frdir/te" > "$out/logs/frontier-$name-te.log" 2>&1
      echo "frontier-$name-te exit $?" >> "$out/logs/status"
      if [[ ! -f "$frdir/te/$name.json" ]]; then
        CUDA_VISIBLE_DEVICES=$gpu timeout "${JOB_TIMEOUT:-420}" "${fr[@]}" "$@" --backend local --name "$name" \
            --out "$frdir/local" > "$out/logs/frontier-$name-local.log" 2>&1
        echo "frontier-$name-local exit $?" >> "$out/logs/status"
      fi ) &
    (( ++started % ngpu )) || wait  # every GPU busy: the next report waits for these (one report per GPU)
  }
  started=0
  # index_topk cut to 256 so that the indexer selects in the 512- and 300-token sequences
  mkdir -p "$frdir"
  frontier DeepseekV32ForCausalLM "$(g 0)" --config tests/fixtures/configs/deepseek-v3.2-exp.json "${dsa[@]}" \
      --set n_routed_experts=32 --set index_topk=256 --lengths 512,512,300,100
  frontier GlmMoeDsaForCausalLM "$(g 1)" --config tests/fixtures/configs/glm-5.json "${dsa[@]}" \
      --set n_routed_experts=32 --set index_topk=256 --lengths 512,512,300,100
  frontier GptOssForCausalLM "$(g 2)" --config tests/fixtures/configs/gpt-oss-20b.json --set num_hidden_layers=2 \
      --set 'layer_types=["sliding_attention","full_attention"]' --lengths 512,512,300,100
  # DeepSeek-V3.2 at its published index_topk (2048), 16 routed experts: selection in the last 512 positions
  # of a 2560-token sequence (on a fourth GPU only: it would lengthen the phase on fewer)
  if (( ngpu >= 4 )); then
    frontier DeepseekV32ForCausalLM-topk2048 "$(g 3)" --config tests/fixtures/configs/deepseek-v3.2-exp.json \
        "${dsa[@]}" --set n_routed_experts=16 --lengths 2560,300
  fi
  wait
  $py bench/gpu/frontier_parity.py --summarize "$frdir" > "$out/logs/frontier-summary.log" 2>&1
  echo "frontier-summary exit $?" >> "$out/logs/status"
fi

if [[ " $phases " == *" hybrid-gpu "* || " $phases " == *" hybrid-fla "* ]]; then
  # the gated DeltaNet models of both hybrid phases: published configs, 4 layers (3 gated DeltaNet, 1 gated
  # attention), 64 routed experts, the Qwen3.5 vision tower cut to one block
  cfgs=tests/fixtures/configs
  four='["linear_attention","linear_attention","linear_attention","full_attention"]'
  next=(--config "$cfgs/qwen3-next-80b-a3b.json" --random-weights --set num_hidden_layers=4 --set num_experts=64)
  # text only (--images 0): the language models, as these phases measured them before the tower was built
  q35=(--random-weights --set text_config.num_hidden_layers=4 --set "text_config.layer_types=$four" --set vision_config.depth=1
       --images 0)
  q35dense=(--config "$cfgs/qwen3.5-9b.json" "${q35[@]}")
  q35moe=(--config "$cfgs/qwen3.5-35b-a3b.json" "${q35[@]}" --set text_config.num_experts=64)
fi

if [[ " $phases " == *" hybrid-gpu "* ]]; then
  # Gated DeltaNet models (Qwen3-Next-80B-A3B, Qwen3.5-9B, Qwen3.5-35B-A3B published configs) at full
  # width, 4 layers (3 gated DeltaNet, 1 gated attention), 64 routed experts, bf16, random weights.
  # Backend local: the gated DeltaNet layer has no Transformer Engine build. transformers runs its torch
  # fallback of the layer (no flash-linear-attention / causal-conv1d here). Reports to $out/parity/gpu-hybrid/
  # (docs/parity/gpu-hybrid/README.md). Four chains, one per GPU (fewer GPUs: they share); each sub-run is
  # logged and its exit code recorded, a failure does not stop the next. The vLLM sub-runs need
  # bench/gpu/vllm-setup.sh and `source bench/gpu/vllm-env.sh` before run_all.sh; without it they are skipped.
  # reference checkpoints (several GB each) in HYBRID_WORK, default a fresh temporary folder, removed at the end
  hy="$out/parity/gpu-hybrid"; work=${HYBRID_WORK:-$(mktemp -d)}; mkdir -p "$hy"
  hrep=($py -m mcore_zoo.cli parity-report --dtype bfloat16 --device cuda -q -v --backend local --lengths 512,512,300,100)
  # bitwise needs equal lengths on BSHD (no padding rows: the GEMMs see the reference's row counts), as moe-exact;
  # the MoE models on a THD pack (transformers runs each sequence alone: a BSHD batch's experts would multiply
  # four sequences' rows per GEMM where transformers' see one sequence's)
  exact=(--numerics hf-exact --bitwise --no-baseline --lengths 512,512,512,512 --seq-format bshd --out "$hy/local-hf-exact")
  exact_thd=(--numerics hf-exact --bitwise --no-baseline --lengths 512,300,100,37 --out "$hy/local-hf-exact-thd")
  vllm=(--no-baseline --vllm --vllm-arg gpu_memory_utilization=0.5 --vllm-arg gdn_prefill_backend=triton --out "$hy/local-vllm")
  hyrun() {  # hyrun NAME GPU CMD...: one sub-run of a chain on GPU, log, record the exit code
    local name=$1 gpu=$2
    shift 2
    CUDA_VISIBLE_DEVICES=$gpu timeout "${HYBRID_TIMEOUT:-240}" "$@" > "$out/logs/$name.log" 2>&1
    echo "$name exit $?" >> "$out/logs/status"
  }
  hychain() {  # hychain N: chain N (1-4) selected by HYBRID_CHAINS (default all four; e.g. "1 2" then "3 4" on one GPU)
    [[ " ${HYBRID_CHAINS:-1 2 3 4} " == *" $1 "* ]]
  }
  hyvllm() {  # hyvllm NAME GPU CMD...: hyrun when vLLM's environment is set up, else recorded as skipped
    if [ -n "${MCORE_ZOO_VLLM_PYTHON:-}" ]; then hyrun "$@"
    else echo "$1 skipped: no MCORE_ZOO_VLLM_PYTHON (source bench/gpu/vllm-env.sh)" >> "$out/logs/status"; fi
  }
  # the zoo (default profile) vs HF eager with HF's sdpa-vs-eager spread; then hf-exact (split-K off) on the
  # same reference checkpoint, bitwise vs HF eager or the measured gap; vLLM 0.26 on the zoo's export
  hychain 1 && ( hyrun hybrid-next "$(g 0)" "${hrep[@]}" "${next[@]}" --work-dir "$work/next" --out "$hy/local"
    hyrun hybrid-next-exact "$(g 0)" "${nosplit[@]}" "${hrep[@]}" --model "$work/next/reference" "${exact_thd[@]}"
    # THD vs BSHD forward + backward time of one gated DeltaNet layer (the bound: THD <= 1.05 x BSHD)
    hyrun hybrid-thd-speed "$(g 0)" $py bench/gpu/gated_deltanet_speed.py --out "$hy/gated_deltanet_thd.json" ) &
  hychain 2 && ( hyrun hybrid-q35 "$(g 1)" "${hrep[@]}" "${q35dense[@]}" --work-dir "$work/q35" --out "$hy/local"
    hyrun hybrid-q35-exact "$(g 1)" "${nosplit[@]}" "${hrep[@]}" --model "$work/q35/reference" "${exact[@]}" ) &
  hychain 3 && ( hyrun hybrid-q35moe "$(g 2)" "${hrep[@]}" "${q35moe[@]}" --work-dir "$work/q35moe" --out "$hy/local"
    hyrun hybrid-q35moe-exact "$(g 2)" "${nosplit[@]}" "${hrep[@]}" --model "$work/q35moe/reference" --images 0 "${exact_thd[@]}"
    hyvllm hybrid-next-vllm "$(g 2)" "${hrep[@]}" "${next[@]}" "${vllm[@]}"
    # (full width, random weights: the report builds for minutes before vLLM starts)
    HYBRID_TIMEOUT=${HYBRID_VLLM_TIMEOUT:-600} hyvllm hybrid-q35moe-vllm "$(g 2)" "${hrep[@]}" --model "$work/q35moe/reference" --images 0 \
        "${vllm[@]}" --vllm-arg language_model_only=true ) &
  # refit into an in-process vLLM engine bit for bit (Qwen3-Next, Qwen3.5; token_mult_prob_error after it),
  # then vLLM on Qwen3.5's full-width export
  hychain 4 && ( HYBRID_TIMEOUT=${HYBRID_REFIT_TIMEOUT:-360} MCORE_ZOO_GPU_RESULTS="$hy" hyvllm hybrid-refit "$(g 3)" $py -m pytest -p mcore_zoo.testing.plugin \
        tests/gpu/test_refit_gated_deltanet_gpu.py -q -s -p no:cacheprovider
    hyvllm hybrid-q35-vllm "$(g 3)" "${hrep[@]}" "${q35dense[@]}" "${vllm[@]}" --vllm-arg language_model_only=true ) &
  wait
  [ -n "${HYBRID_WORK:-}" ] || rm -rf "$work"
fi

if [[ " $phases " == *" hybrid-fla "* ]]; then
  # The gated DeltaNet models above on te (Transformer Engine linears, attention and zero-centred norms) with the gated DeltaNet layer on flash-linear-
  # attention's kernels (linear_attention_kernel=fla: refused, never replaced, where fla cannot run), default
  # profile, bf16, vs HF eager on transformers' torch fallbacks with HF's own sdpa-vs-eager spread:
  # bench/gpu/hybrid_fla_parity.py imports transformers with fla hidden and records the kernels of both sides
  # in each report. A te run that writes no report is followed by the same run on local (fla kernels).
  # Then fla's THD (one varlen call) vs padded BSHD speed of one layer and the fla GPU test. fla lives in
  # FLA_SITE (bash bench/gpu/fla-setup.sh WHEEL_DIR), on PYTHONPATH for these runs only. Reports to
  # $out/parity/gpu-hybrid/{te-fla,local-fla}/ (docs/parity/gpu-hybrid/README.md).
  hy="$out/parity/gpu-hybrid"; mkdir -p "$hy"
  fla_site=${FLA_SITE:-/tmp/fla-site}
  if [ ! -f "$fla_site/.ready" ]; then
    echo "hybrid-fla skipped: no fla in $fla_site (bash bench/gpu/fla-setup.sh WHEEL_DIR)" >> "$out/logs/status"
  else
    # FLA_TILELANG=0: fla's Triton kernels, not TileLang (vLLM's dependency; it aborted these runs: fla-env.sh)
    flpy=(env PYTHONPATH="$fla_site:$(pwd)/src:$(pwd)${PYTHONPATH:+:$PYTHONPATH}" FLA_TILELANG="${FLA_TILELANG:-0}" $py)
    flrep=("${flpy[@]}" bench/gpu/hybrid_fla_parity.py -- --dtype bfloat16 --device cuda -q -v
           --knob linear_attention_kernel=fla --lengths 512,512,300,100)
    flrun() {  # flrun NAME GPU CMD...: one sub-run on GPU, log, record the exit code
      local name=$1 gpu=$2
      shift 2
      CUDA_VISIBLE_DEVICES=$gpu timeout "${HYBRID_TIMEOUT:-300}" "$@" > "$out/logs/$name.log" 2>&1
      echo "$name exit $?" >> "$out/logs/status"
    }
    flreport() {  # flreport NAME GPU ARCHITECTURE ARGS...: te with fla; local with fla when te wrote no report
      local name=$1 gpu=$2 arch=$3
      shift 3
      flrun "$name-te" "$gpu" "${flrep[@]}" "$@" --backend te --out "$hy/te-fla"
      [ -f "$hy/te-fla/$arch.json" ] || flrun "$name-local" "$gpu" "${flrep[@]}" "$@" --backend local --out "$hy/local-fla"
    }
    ( flreport hybrid-fla-next "$(g 0)" Qwen3NextForCausalLM "${next[@]}"
      # THD varlen vs padded BSHD on fla, and fla vs the torch path (the bound: THD <= 1.05 x BSHD)
      # FLA_FIRST_TIMEOUT: a fresh machine autotunes fla's kernels at first use (2026-11-27: 32 autotuning
      # runs, 325 s, before the speed bench's first timed step); the speed bench autotunes (fla's own
      # configs), its results cached on disk for later processes
      HYBRID_TIMEOUT=${FLA_FIRST_TIMEOUT:-900} flrun hybrid-fla-speed "$(g 0)" env TRITON_PRINT_AUTOTUNING=1 "${flpy[@]}" \
          bench/gpu/gated_deltanet_speed.py --kernel fla --profile --out "$hy/gated_deltanet_fla_speed.json" ) &
    flreport hybrid-fla-q35 "$(g 1)" Qwen3_5ForConditionalGeneration "${q35dense[@]}" &
    flreport hybrid-fla-q35moe "$(g 2)" Qwen3_5MoeForConditionalGeneration "${q35moe[@]}" &
    # the GPU test with fla's autotuners pinned to one config each (bench/gpu/fla_pinned.py; a parity
    # check needs no autotuning: 81 s instead of minutes of compilation on a fresh machine)
    MCORE_ZOO_GPU_RESULTS="$hy" flrun hybrid-fla-test "$(g 3)" "${flpy[@]}" bench/gpu/fla_pinned.py -m pytest \
        -p mcore_zoo.testing.plugin tests/gpu/test_gated_deltanet_fla_gpu.py -q -s -p no:cacheprovider &
    wait
  fi
fi

if [[ " $phases " == *" vl-gpu "* ]]; then
  # Vision-language models (Qwen2.5-VL-7B, Qwen3-VL-8B, Qwen3-VL-30B-A3B published configs) at full width, 4
  # decoder layers, a 4-block tower at full width (Qwen3-VL: 3 deepstack levels), 64 routed experts, bf16, random
  # weights; two images of random pixels (8 x 8 merged features each) in each sequence long enough for them.
  # Per model: te (default profile) vs HF eager with HF's sdpa-vs-eager spread, per-layer sites of the tower,
  # the merger and the decoder; hf-exact on local (split-K off) vs HF eager - bitwise for the dense models - with
  # the pack vs each sequence alone (--invariance); then the refit into vLLM (tests/gpu/test_refit_vision_language_gpu.py,
  # needs `source bench/gpu/vllm-env.sh`, else skipped). Reports to $out/parity/gpu-vl/; one chain per GPU.
  # reference checkpoints in VL_WORK, default a fresh temporary folder, removed at the end
  vl="$out/parity/gpu-vl"; work=${VL_WORK:-$(mktemp -d)}; mkdir -p "$vl"
  cfgs=tests/fixtures/configs
  vopts=(--dtype bfloat16 --device cuda -q -v --lengths 512,512,300,100 --images 2 --image-size 8)
  vrep=($py -m mcore_zoo.cli parity-report "${vopts[@]}")
  q25=(--config "$cfgs/qwen2.5-vl-7b-instruct.json" --random-weights --set num_hidden_layers=4 --set vision_config.depth=4
       --set "vision_config.fullatt_block_indexes=[3]")
  q3=(--random-weights --set text_config.num_hidden_layers=4 --set vision_config.depth=4
      --set "vision_config.deepstack_visual_indexes=[0,1,2]")
  q3dense=(--config "$cfgs/qwen3-vl-8b-instruct.json" "${q3[@]}")
  q3moe=(--config "$cfgs/qwen3-vl-30b-a3b-instruct.json" "${q3[@]}" --set text_config.num_experts=64)
  exact=(--backend local --numerics hf-exact --no-baseline --invariance --out "$vl/local-hf-exact")
  vte=("${vrep[@]}")  # te: declared by the vision-language plugins since these runs showed it
  vlrun() {  # vlrun NAME GPU CMD...: one sub-run of a chain on GPU, log, record the exit code
    local name=$1 gpu=$2
    shift 2
    CUDA_VISIBLE_DEVICES=$gpu timeout "${VL_TIMEOUT:-300}" "$@" > "$out/logs/$name.log" 2>&1
    echo "$name exit $?" >> "$out/logs/status"
  }
  ( vlrun vl-q25 "$(g 0)" "${vte[@]}" "${q25[@]}" --backend te --work-dir "$work/q25" --out "$vl/te"
    vlrun vl-q25-exact "$(g 0)" "${nosplit[@]}" "${vrep[@]}" --model "$work/q25/reference" "${exact[@]}" --bitwise ) &
  ( vlrun vl-q3 "$(g 1)" "${vte[@]}" "${q3dense[@]}" --backend te --work-dir "$work/q3" --out "$vl/te"
    vlrun vl-q3-exact "$(g 1)" "${nosplit[@]}" "${vrep[@]}" --model "$work/q3/reference" "${exact[@]}" --bitwise ) &
  # the MoE model: experts as transformers' eager loop (bitwise, the pack too, on 2026-11-27)
  ( vlrun vl-q3moe "$(g 2)" "${vte[@]}" "${q3moe[@]}" --backend te --work-dir "$work/q3moe" --out "$vl/te"
    vlrun vl-q3moe-exact "$(g 2)" "${nosplit[@]}" "${vrep[@]}" --model "$work/q3moe/reference" "${exact[@]}" \
        --knob moe_experts=eager --bitwise ) &
  if [ -n "${MCORE_ZOO_VLLM_PYTHON:-}" ]; then
    ( VL_TIMEOUT=${VL_REFIT_TIMEOUT:-600} MCORE_ZOO_GPU_RESULTS="$vl" vlrun vl-refit "$(g 3)" $py -m pytest \
        -p mcore_zoo.testing.plugin tests/gpu/test_refit_vision_language_gpu.py -q -s -p no:cacheprovider ) &
  else echo "vl-refit skipped: no MCORE_ZOO_VLLM_PYTHON (source bench/gpu/vllm-env.sh)" >> "$out/logs/status"; fi
  wait
  [ -n "${VL_WORK:-}" ] || rm -rf "$work"
fi
cat "$out/logs/status"

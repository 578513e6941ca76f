#!/usr/bin/env bash
# Every GPU measurement the docs cite, on one machine with 4 GPUs (fewer: phases serialise).
# Run from the repository root with megatron-core and Transformer Engine importable and
# PYTHONPATH=src (see ../shared/gpu/README.md):   bash bench/gpu/run_all.sh OUT [PHASE...]
# Phases: reports (parity-report jobs, one GPU each, in parallel), checks (GPU tests and the
# backend / profile grid), speed, multi (torchrun 2 / 4). Default: all four.
# Each job logs to OUT/logs/; a failing (or, past its time limit, killed) job is recorded and the
# others go on. Limits: JOB_TIMEOUT (single-GPU jobs, default 420 s), MULTI_TIMEOUT (torchrun jobs,
# default 240 s: a layout failing on some ranks only would otherwise wait for NCCL's timeout).
set -uo pipefail
out=${1:?usage: run_all.sh OUT [single|speed|multi]...}
shift
phases=${*:-reports checks speed multi}
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

g() { echo $(( $1 % ngpu )); }
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
cat "$out/logs/status"

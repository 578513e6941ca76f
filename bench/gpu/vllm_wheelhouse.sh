#!/usr/bin/env bash
# vLLM for the GPU machine, in transfers of at most 48 MB (the device takes 64 MiB a call,
# the working tree included). Run from the project root, on a machine with PyPI:
#
#     bash bench/gpu/vllm_wheelhouse.sh
#
# 1. bench/gpu/vllm_resolve.py downloads vllm==${VLLM_VERSION:-0.26.0} and every requirement the
#    GPU machine lacks (read from each wheel's Requires-Dist; py3.12 manylinux x86_64 wheels,
#    --no-deps, one package at a time) into .gpu/vllm/dl/, and lists them in wheels.tsv.
# 2. Wheels over 48 MB are cut into 48 MB parts; parts and whole wheels are packed
#    (largest first) into folders .gpu/vllm/c0, c1, ... of at most 48 MB each.
# 3. .gpu/vllm/meta/manifest.tsv: each wheel's name, md5 and parts (the device checks them).
#
# .gpu/ is in .git/info/exclude: nothing here is committed. Device side: bench/gpu/vllm-setup.sh
# (its header has the calls). Re-running reuses the downloads. VLLM_LEAN=1: see below.
#
# STACK=sglang: the same for SGLang (RESOLVE_ROOT, default sglang==0.5.17, the release that pins
# the GPU machine's torch 2.11.0) into .gpu/sglang/; install with STACK=sglang vllm-setup.sh.
set -euo pipefail
root="$(pwd)"
STACK=${STACK:-vllm}
out="$root/.gpu/$STACK"
if [ "$STACK" = sglang ]; then export RESOLVE_ROOT=${RESOLVE_ROOT:-sglang==0.5.17}; fi
limit=$((48 * 1024 * 1024))
exclude="$(git rev-parse --git-path info/exclude)"; mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
mkdir -p "$out/dl" "$out/meta"
skipfile="$out/meta/skip.txt"
: > "$skipfile"
[ -n "${VLLM_SKIP_FILE:-}" ] && cat "$VLLM_SKIP_FILE" >> "$skipfile"
# VLLM_LEAN=1: leave out kernels vLLM imports only on first use, for paths a bf16 LLM on Hopper
# does not take: tokenspeed-mla (MLA prefill on Blackwell only, + tokenspeed-triton) and humming-kernels (MXFP4 /
# NVFP4 / MXFP8 kernels, + nvidia-cuda-nvcc / nvvm / cccl): 790 MB instead of 1012 MB.
[ "${VLLM_LEAN:-0}" = 1 ] && printf 'tokenspeed-mla\nhumming-kernels\n' >> "$skipfile"
# SGLang: flash-attn-4 (Blackwell attention; its newest release conflicts with SGLang's
# nvidia-cutlass-dsl pin), tokenspeed-mla and humming-kernels, as above: 1055 MB
[ "$STACK" = sglang ] && printf 'flash-attn-4\ntokenspeed-mla\nhumming-kernels\n' >> "$skipfile"
python3 "$root/bench/gpu/vllm_resolve.py" "$out/dl" --skip-file "$skipfile"
: > "$out/meta/force.txt"
if [ "$STACK" = sglang ]; then
  # SGLang 0.5.17 pins transformers 5.12.1: the image's newer transformers already registers a
  # config name (qwen3_asr) SGLang registers at engine start. 5.12.1 takes tokenizers <= 0.23.0.
  # Both are installed into SGLang's own site even though the image has (other versions of) them.
  for pin in transformers==5.12.1 tokenizers==0.22.2; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$out/dl" "$pin"
    name=${pin%%==*}; version=${pin##*==}
    file=$(cd "$out/dl" && ls "$name-$version-"*.whl | head -1)
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$version" "$(stat -c %s "$out/dl/$file")" "$file" "sglang (pin over the image)" >> "$out/dl/wheels.tsv"
    echo "$name" >> "$out/meta/force.txt"
  done
fi
rm -rf "$out"/c[0-9]* "$out/parts" && mkdir -p "$out/parts"
: > "$out/meta/manifest.tsv"
tail -n +2 "$out/dl/wheels.tsv" | while IFS=$'\t' read -r name version bytes file by; do
  md5="$(md5sum "$out/dl/$file" | cut -d' ' -f1)"
  if [ "$bytes" -gt "$limit" ]; then
    ( cd "$out/parts" && split -b 48M -d -a 2 "$out/dl/$file" "$file.part" )
    n=$(ls "$out/parts/$file".part* | wc -l)
  else
    ln -f "$out/dl/$file" "$out/parts/$file" 2>/dev/null || cp "$out/dl/$file" "$out/parts/$file"
    n=0
  fi
  printf '%s\t%s\t%s\n' "$file" "$md5" "$n" >> "$out/meta/manifest.tsv"
done
# first-fit decreasing into 48 MB folders
python3 - "$out" "$limit" <<'PY'
import os, sys
out, limit = sys.argv[1], int(sys.argv[2])
files = sorted(os.listdir(f"{out}/parts"), key=lambda f: -os.path.getsize(f"{out}/parts/{f}"))
bins = []  # [used, [files]]
for f in files:
    size = os.path.getsize(f"{out}/parts/{f}")
    for b in bins:
        if b[0] + size <= limit:
            b[0] += size; b[1].append(f); break
    else:
        bins.append([size, [f]])
for i, (used, names) in enumerate(bins):
    os.makedirs(f"{out}/c{i}")
    for f in names:
        os.replace(f"{out}/parts/{f}", f"{out}/c{i}/{f}")
print(f"{len(bins)} chunk folders: {out}/c0 .. c{len(bins) - 1}")
PY
rmdir "$out/parts"
cp "$out/dl/wheels.tsv" "$out/meta/"
[ -f "$out/dl/missing.txt" ] && cp "$out/dl/missing.txt" "$out/meta/"
du -sh "$out"/c[0-9]* | sort -k2 -V | tr '\n' ' '; echo
echo "total: $(du -cb "$out"/c[0-9]* | tail -1 | cut -f1) bytes in $(ls -d "$out"/c[0-9]* | wc -l) transfers"

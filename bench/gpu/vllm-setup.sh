#!/usr/bin/env bash
# Runs ON the GPU machine, from the project root: installs the vLLM wheels that
# bench/gpu/vllm_wheelhouse.sh prepared into /tmp/vllm-site. Device calls (run tool), in order:
#
#   for each N:  carry [".gpu/vllm/cN"]   command: mkdir -p /tmp/vllm-wh && cp .gpu/vllm/cN/* /tmp/vllm-wh/
#   then:        carry [".gpu/vllm/meta"] command: bash bench/gpu/vllm-setup.sh && source bench/gpu/vllm-env.sh && ...
#
# It joins the parts of split wheels, checks every wheel's md5 against meta/manifest.tsv, and
# installs (pip --no-index --no-deps --target) only the distributions the machine's python3 does
# not already have, so nothing it ships replaces a package of the image. Idempotent: a second run
# on the same machine only checks. Chunks may be sent in any order; a missing one is named.
#
# STACK=sglang: SGLang's wheels (STACK=sglang vllm_wheelhouse.sh) from .gpu/sglang/cN into
# /tmp/sglang-wh, installed into /tmp/sglang-site (a site of its own: its pins differ from vLLM's).
set -euo pipefail
STACK=${STACK:-vllm}
W=/tmp/$STACK-wh
S=/tmp/$STACK-site
manifest=.gpu/$STACK/meta/manifest.tsv
[ -f "$manifest" ] || { echo "no $manifest: carry .gpu/$STACK/meta with this call"; exit 2; }
if [ ! -f "$W/.ready" ]; then
  t0=$(date +%s)
  bad=0
  install=()
  while IFS=$'\t' read -r file md5 parts; do
    if [ "$parts" -gt 0 ] && [ ! -f "$W/$file" ]; then
      have=$(ls "$W/$file".part* 2>/dev/null | wc -l)
      [ "$have" -eq "$parts" ] || { echo "missing parts of $file: $have of $parts"; bad=1; continue; }
      cat "$W/$file".part* > "$W/$file" && rm -f "$W/$file".part*
    fi
    [ -f "$W/$file" ] || { echo "missing wheel $file (a chunk was not sent)"; bad=1; continue; }
    [ "$(md5sum "$W/$file" | cut -d' ' -f1)" = "$md5" ] || { echo "checksum mismatch: $file (resend its chunk)"; bad=1; continue; }
    dist="${file%%-*}"
    if ! grep -qx "$dist" ".gpu/$STACK/meta/force.txt" 2>/dev/null && \
        python3 -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" 2>/dev/null; then
      echo "skip $dist (the image has $(python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$dist"))"
    else
      install+=("$W/$file")
    fi
  done < "$manifest"
  [ "$bad" -eq 0 ] || exit 3
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$S" "${install[@]}"
  touch "$W/.ready"
  echo "installed ${#install[@]} wheels into $S in $(( $(date +%s) - t0 )) s"
fi
PYTHONPATH="$S${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import $STACK as m, torch; print('$STACK', m.__version__, '| torch', torch.__version__, '|', torch.cuda.get_device_name())"

#!/usr/bin/env bash
# Device-side wrapper (gpu helper, session 8): unpack the gpu branch's tree (code.tar, `git archive`) to
# /root/t, gather the carried bundle folders in /root/gb (kept while the machine stays warm), run one
# stage of scripts/gpu/device_run.sh there, and pack everything it wrote into $OUT/out.tgz (at most 8
# files come back) beside its JSON files and a copy of its short logs.
# usage (from the checkout root on the device): bash .gpu-carry/go.sh STAGE
set -uo pipefail
C=$PWD/.gpu-carry
mkdir -p /root/gb
for d in "$C"/gb/*/; do
  [ -d "$d" ] || continue
  n=$(basename "$d"); [ -d "/root/gb/$n" ] || cp -r "$d" "/root/gb/$n"
done
if [ -f "$C/code.tar" ]; then rm -rf /root/t && mkdir -p /root/t && tar -xf "$C/code.tar" -C /root/t; fi
cat "$C/code.commit" 2>/dev/null
cd /root/t || exit 3
ln -sfn /root/gb gpu-bundle
REAL_OUT=$OUT; export OUT=/tmp/out_$1_$SECONDS; mkdir -p "$OUT"
cp "$C/code.commit" "$OUT/" 2>/dev/null
bash scripts/gpu/device_run.sh "$@"; rc=$?
tar -czf "$REAL_OUT/out_$1.tgz" -C "$OUT" .
ls -S "$OUT"/*.json 2>/dev/null | head -5 | xargs -r cp -t "$REAL_OUT/"
echo "go.sh $1 rc=$rc; files: $(ls "$OUT" | tr '\n' ' ')"
exit $rc

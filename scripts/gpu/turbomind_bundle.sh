#!/usr/bin/env bash
# Bring LMDeploy's TurboMind to a GPU host that lacks it (issue #16): the lent H200 host has CUDA 13
# (torch cu130) while lmdeploy 0.18.0's TurboMind binary links CUDA 12 libraries, and the regular
# bundle (../shared/gpu/make-bundle.sh) strips the binary to fit. A device call carries < 64 MiB, so
# this cuts what TurboMind needs into parts of TM_PART_MB (default 58) MiB, one folder per call:
#   DIR/tm-00 … DIR/tm-NN, each with its part, the manifest and scripts/gpu/turbomind_host.sh.
# What is carried (readelf -d NEEDED of _turbomind.so): libcublas.so.12, libcublasLt.so.12,
# libcudart.so.12 (+ the binary and its nccl stub). NOT carried: libnccl.so.2 (the host has one,
# from torch's nvidia-nccl-cu13 wheel: same soname and ABI) and libcurand.so.10 (listed in lmdeploy's
# metadata but not linked by the binary). Packed as one tar.xz (Python's lzma can unpack it where
# the host has no xz).
# usage: scripts/gpu/turbomind_bundle.sh DIR    (DIR inside the checkout, listed in .git/info/exclude)
set -euo pipefail
D=${1:?usage: turbomind_bundle.sh DIR}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/whl" \
  lmdeploy==0.18.0 "nvidia-cublas-cu12==${CUBLAS_VERSION:-12.9.3.13}" "nvidia-cuda-runtime-cu12==${CUDART_VERSION:-12.9.79}"
mkdir -p "$work/tree/lmdeploy" "$work/tree/cu12/lib"
unzip -q "$work"/whl/lmdeploy-0.18.0-*.whl 'lmdeploy/turbomind/_turbomind*' 'lmdeploy/turbomind/lib/*' -d "$work/tree"
unzip -q -j "$work"/whl/nvidia_cublas_cu12-*.whl 'nvidia/cublas/lib/libcublas.so.12' 'nvidia/cublas/lib/libcublasLt.so.12' \
  -d "$work/tree/cu12/lib"
unzip -q -j "$work"/whl/nvidia_cuda_runtime_cu12-*.whl 'nvidia/cuda_runtime/lib/libcudart.so.12' -d "$work/tree/cu12/lib"
# written beside the tree, then moved in: a manifest created inside it would list itself (session 6: FAILED)
(cd "$work/tree" && find . -type f -print0 | sort -z | xargs -0 sha256sum > ../MANIFEST.sha256)
mv "$work/MANIFEST.sha256" "$work/tree/MANIFEST.sha256"
tar -C "$work/tree" -cf - . | xz -T"${XZ_THREADS:-2}" -6 > "$work/turbomind.tar.xz"
rm -rf "$D"/tm-*
(cd "$work" && split -b "${TM_PART_MB:-58}M" -d -a 2 turbomind.tar.xz tm.part.)
sha=$(sha256sum "$work/turbomind.tar.xz" | cut -d' ' -f1)
n=$(ls "$work"/tm.part.* | wc -l)
for p in "$work"/tm.part.*; do
  i=${p##*.}; mkdir -p "$D/tm-$i"; mv "$p" "$D/tm-$i/"
  printf '%s  turbomind.tar.xz\n%s parts\n' "$sha" "$n" > "$D/tm-$i/turbomind.sha256"
  cp "$here/turbomind_host.sh" "$D/tm-$i/"
done
du -sh "$D"/tm-* | tr '\n' ' '; echo; echo "sha256 $sha, $n parts"

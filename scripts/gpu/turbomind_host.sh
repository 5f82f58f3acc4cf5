#!/usr/bin/env bash
# On the GPU host, once per carried part (see turbomind_bundle.sh): keep the part under /root/tm-parts;
# when all parts are there, reassemble, check sha256 (whole archive and every file), and install:
# the binary into /root/site/lmdeploy/turbomind/ (over the stripped lmdeploy wheel), the CUDA 12
# libraries into /root/cu12/lib, kept OUT of sys.path so torch's own CUDA 13 loader never sees them.
# Prints the LD_LIBRARY_PATH to export (CUDA 12 libs + the host's libnccl.so.2 from torch's wheel).
# usage: bash BUNDLE/tm-NN/turbomind_host.sh BUNDLE
set -euo pipefail
B=${1:?usage: turbomind_host.sh BUNDLE_DIR}
P=/root/tm-parts; mkdir -p "$P"
for d in "$B"/tm-*; do compgen -G "$d/tm.part.*" >/dev/null && cp --update=none "$d"/tm.part.* "$P/"; done
m=$(ls "$B"/tm-*/turbomind.sha256 | head -1); meta="$(cd "$(dirname "$m")" && pwd)/$(basename "$m")"  # absolute: used after cd
want=$(sed -n 2p "$meta" | cut -d' ' -f1); have=$(ls "$P" | grep -c '^tm.part' || true)
echo "turbomind parts: $have/$want"
if [ "$have" != "$want" ] || [ -f /root/cu12/.done ]; then exit 0; fi
cat "$P"/tm.part.* > /root/turbomind.tar.xz
(cd /root && head -1 "$meta" | sha256sum -c -)
mkdir -p /root/tm-tree && cd /root/tm-tree
if command -v xz >/dev/null; then xz -dc /root/turbomind.tar.xz | tar -xf -
else python3 -c "import lzma,tarfile,sys; tarfile.open(fileobj=lzma.open(sys.argv[1])).extractall('.')" /root/turbomind.tar.xz; fi
# (bundles made before session 6 list the manifest itself, whose hash cannot match: it is left out)
grep -v ' \./MANIFEST\.sha256$' MANIFEST.sha256 | sha256sum -c --quiet - || { echo "file check FAILED"; exit 1; }
echo "all files verified"
mkdir -p /root/site/lmdeploy/turbomind /root/cu12
cp -r lmdeploy/turbomind/. /root/site/lmdeploy/turbomind/
cp -r cu12/lib /root/cu12/
rm -f /root/turbomind.tar.xz; touch /root/cu12/.done
nccl=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null || true)
echo "export LD_LIBRARY_PATH=/root/cu12/lib${nccl:+:$nccl}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"

#!/usr/bin/env bash
# here (copy it and go.sh to /work/main/.gpu-carry/, listed in /work/main/.git/info/exclude): the gpu branch's HEAD (committed work only) as .gpu-carry/code.tar for go.sh
set -euo pipefail
cd /work/wt/gpu
git archive --format=tar -o /work/main/.gpu-carry/code.tar HEAD
echo "gpu branch $(git rev-parse --short HEAD) ($(git log -1 --format=%s | cut -c1-70)); main $(git -C /work/main rev-parse --short HEAD)" > /work/main/.gpu-carry/code.commit
cat /work/main/.gpu-carry/code.commit; ls -la /work/main/.gpu-carry/code.tar

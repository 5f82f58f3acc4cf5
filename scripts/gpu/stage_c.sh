#!/usr/bin/env bash
# Stage C2: GPU suite then the bf16 probe (both need the SmolLM2 folder).
set -uo pipefail
[ -n "${1:-}" ] && bash "gpu-bundle/$1/host-setup.sh" gpu-bundle > "$OUT/setup_C.log" 2>&1
export PYTHONPATH=/root/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 LMDQ_GPU_TOKENIZER=$PWD/gpu-bundle/tok
M=/root/models/smollm2-135m-instruct
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys,torch,lmdeploy,transformers,triton;print('python',sys.version.split()[0],'torch',torch.__version__,'cuda',torch.version.cuda,'lmdeploy',lmdeploy.__version__,'transformers',transformers.__version__,'triton',triton.__version__)"
} > "$OUT/env.txt" 2>&1
timeout 330 python3 -m pytest tests/gpu/test_lmdeploy_gpu.py -v -p no:cacheprovider -rA 2>&1 | grep -v DEBUG > "$OUT/gpu_suite.log"
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_suite.log" | tail -16
timeout 200 python3 scripts/gpu/bf16_probe.py $M > "$OUT/bf16_probe.log" 2>&1
tail -4 "$OUT/bf16_probe.log"

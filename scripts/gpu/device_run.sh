#!/usr/bin/env bash
# One stage of the GPU validation, run on the device machine from the repo root (see docs/gpu-validation.md).
# Stages A, B, C carry gpu-bundle/1-wheels, 2-model-a, 3-model-b in turn (made by ../shared/gpu/make-bundle.sh
# plus pytest wheels, and gpu-bundle/tok with SmolLM2's tokenizer files).
set -uo pipefail
stage=${1:?stage A|B|C|D}
part=${2:-}
[ -n "$part" ] && bash "gpu-bundle/$part/host-setup.sh" gpu-bundle > "$OUT/setup_$stage.log" 2>&1
export PYTHONPATH=/root/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 LMDQ_GPU_TOKENIZER=$PWD/gpu-bundle/tok
M=/root/models/smollm2-135m-instruct
case $stage in
  A)
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
      python3 -c "import sys,torch,lmdeploy,transformers,triton;print('python',sys.version.split()[0],'torch',torch.__version__,'cuda',torch.version.cuda,'lmdeploy',lmdeploy.__version__,'transformers',transformers.__version__,'triton',triton.__version__)"
    } > "$OUT/env.txt" 2>&1
    python3 -m pytest tests/gpu/test_parity.py -v -p no:cacheprovider 2>&1 | tee "$OUT/parity.log" | tail -15
    python3 -m bench efficiency --engine lmdeploy --random-llama8b /root/llama8b --tokenizer-from gpu-bundle/tok \
      --n 1024 --batch-size 32 --input-len 234 --output-len 256 -o "$OUT/efficiency_gpu_tp1.json" 2>&1 \
      | tee "$OUT/efficiency_tp1.log" | tail -8
    ;;
  B)
    python3 -m bench efficiency --engine lmdeploy --random-llama8b /root/llama8b --tokenizer-from gpu-bundle/tok \
      --tp 2 --skip-naive --n 1024 --batch-size 32 --input-len 234 --output-len 256 \
      -o "$OUT/efficiency_gpu_tp2.json" 2>&1 | tee "$OUT/efficiency_tp2.log" | tail -8
    ;;
  C)
    python3 -m pytest tests/gpu/test_lmdeploy_gpu.py -v -p no:cacheprovider -rA 2>&1 | tee "$OUT/gpu_suite.log" | tail -25
    ;;
  D)
    python3 scripts/gpu/tp_check.py $M 2>&1 | tee "$OUT/tp_check.log" | tail -5
    python3 scripts/gpu/bf16_probe.py $M 2>&1 | tee "$OUT/bf16_probe.log" | tail -25
    ;;
esac

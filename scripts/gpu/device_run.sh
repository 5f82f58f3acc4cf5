#!/usr/bin/env bash
# One stage of the GPU validation, run on the device machine (2x H200 kind) from the repo root; see
# docs/gpu-validation.md. Four consecutive calls (the machine keeps /root only while warm, 30 s):
#   1 bench   carry gpu-bundle/1-wheels gpu-bundle/tok : efficiency tp=1 (with naive, stream1)
#   2 setup   carry gpu-bundle/2-model-a               : first model half
#   3 suite   carry gpu-bundle/3-model-b gpu-bundle/tok : model conversion, the gpu suite
#   4 tp      (no carry)                               : tp=1 vs tp=2 end to end + orphans, bf16 margins
# plus `parity` (carry 1-wheels, tok) for tests/gpu/test_parity.py; TurboMind (issue #16):
#   tm        carry gpu-bundle/tm-NN (one part a call, after turbomind_bundle.sh): collects parts; with
#             the last one, reassembles + sha256-checks, then TM_RUN=suite|bench|none runs with TurboMind
#   tmsuite / tmbench : the gpu suite on both backends / efficiency for both backends (TurboMind installed;
#             TM_BENCH=0 / PT_BENCH=0 skip one, STREAMED_BENCH=1 adds both with every request streamed)
# `prefix` (carry 1-wheels, tok): lmdq-bench prefix (shuffled document-QA, prefix caching, KV cache for 10 %
# of the documents) on the random 8B shape; PREFIX_ARGS adds flags (e.g. "--docs 300"); and `faults` (carry 1-wheels, tok)
# for tests/gpu/test_faults_gpu.py: engine / worker SIGKILL on the random 8B shape. FAULTS_K=engine_sigkill
# or FAULTS_K=worker_sigkill runs one half (a fresh machine builds the model first: ~2 calls of 600 s).
# `e2e` (issue 27): lmdq-bench e2e, the real CLIs (lmdq-worker, lmdq-producer submit processes) vs a raw pipe()
# process on the same prompts, 3 batches a side. E2E_BACKEND=pytorch|turbomind (turbomind: tm parts carried
# before), E2E_WORKLOAD=mixed (random 8B shape: carry gpu-bundle/tok on a fresh machine) | chat (SmolLM2: after
# `suite` converted it); E2E_PROFILE=1 also profiles one submit of the workload (scripts/gpu/submit_profile.py).
# Session 10: a call killed at its 600 s limit brings nothing back (go.sh packs $OUT after the stage), so the
# suite's timeout counts from this script's start (host setup and model conversion included: SUITE_TIMEOUT is
# the whole budget, default 575 s) and its log is written line by line (grep --line-buffered). The PyTorch
# suite (four files, ~450 s with the LoRA and score engines) no longer fits one call beside a model
# conversion: run it as two, e.g. SUITE_FILES="tests/gpu/test_lmdeploy_gpu.py tests/gpu/test_samples_gpu.py"
# then SUITE_FILES="tests/gpu/test_lora_gpu.py tests/gpu/test_scores_gpu.py", or (session 12, not yet run)
# as two pytest processes at once in one call: SUITE_GROUPS="tests/gpu/test_lmdeploy_gpu.py
# tests/gpu/test_lora_gpu.py;tests/gpu/test_scores_gpu.py tests/gpu/test_samples_gpu.py".
set -uo pipefail
stage=${1:?stage bench|setup|suite|tp|parity|faults|prefix|tm|tmsuite|tmbench|e2e|samples}
for part in 1-wheels 2-model-a 3-model-b; do
  [ -d "gpu-bundle/$part" ] && bash "gpu-bundle/$part/host-setup.sh" gpu-bundle >> "$OUT/setup_$stage.log" 2>&1
done
# pyproject installs src/lmdq as lmdq and worker/, producer/ inside it as lmdq.worker, lmdq.producer
# (package-dir), bench/pyproject.toml installs bench/ as lmdq_bench; nothing is pip-installed here, so src/
# comes first on sys.path and the same import names come from symlinks (untracked, device copy only).
for d in worker producer; do [ -e "src/lmdq/$d" ] || ln -s "../../$d" "src/lmdq/$d"; done
[ -e src/lmdq_bench ] || ln -s ../bench src/lmdq_bench
export PYTHONPATH=/root/site:$PWD/src:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 LMDQ_GPU_TOKENIZER=$PWD/gpu-bundle/tok
M=/root/models/smollm2-135m-instruct
# the suite: test_lmdeploy_gpu.py and the GPU checks of issue 24 (n samples, LoRA, scores) where present;
# SUITE_FILES names others; SUITE_NOTES: the lines the tests print that the call's summary keeps
SUITE_FILES=${SUITE_FILES:-$(ls tests/gpu/test_lmdeploy_gpu.py tests/gpu/test_samples_gpu.py tests/gpu/test_lora_gpu.py \
  tests/gpu/test_scores_gpu.py 2>/dev/null | tr '\n' ' ')}
SUITE_NOTES=${SUITE_NOTES:-"samples-gpu|scores-gpu|lora-gpu|\\[scores|\\[lora"}
env_txt() {
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import sys,torch,lmdeploy,transformers,triton;print('python',sys.version.split()[0],'torch',torch.__version__,'cuda',torch.version.cuda,'lmdeploy',lmdeploy.__version__,'transformers',transformers.__version__,'triton',triton.__version__)"
  } > "$OUT/env.txt" 2>&1
}
eff() {  # eff NAME TP EXTRA... (a --backend in EXTRA wins over the --backend pytorch below)
  local name=$1 tp=$2; shift 2
  timeout "${EFF_TIMEOUT:-300}" python3 -m lmdq_bench efficiency --engine lmdeploy --backend pytorch --random-llama8b /root/llama8b \
    --tokenizer-from gpu-bundle/tok --tp "$tp" --n 1024 --batch-size 32 --input-len 234 --output-len 256 "$@" \
    -o "$OUT/efficiency_gpu_$name.json" > "$OUT/efficiency_$name.log" 2>&1
  grep -E "^rep|^(raw|stream1|lmdq|naive) " "$OUT/efficiency_$name.log" | tail -12
}
tm_env() {  # TurboMind's CUDA 12 libraries (kept off sys.path) + the host's NCCL; see turbomind_host.sh
  for d in gpu-bundle/tm-*; do [ -d "$d" ] && bash "$d/turbomind_host.sh" gpu-bundle >> "$OUT/setup_tm.log" 2>&1; done
  # the install prints the export once; later parts' runs append their "parts: 9/9" after it (session 6)
  grep -q "^export LD_LIBRARY_PATH" "$OUT/setup_tm.log" 2>/dev/null \
    && grep "^export LD_LIBRARY_PATH" "$OUT/setup_tm.log" | tail -1 > /root/tm_env.sh
  [ -f /root/tm_env.sh ] && . /root/tm_env.sh
  python3 -c "import lmdeploy.turbomind as t; print('turbomind available:', t.is_available(), t._import_error or '')"
}
e2e() {  # e2e NAME BACKEND WORKLOAD
  local name=$1 backend=$2 wl=$3 args
  # Byte-compile what the processes import, as any pip install or image does: the wheels here are installed
  # --no-compile and the host writes no .pyc, so every Python start compiled ~350 modules (session 6: most
  # of submit's 1.5-1.9 s before its first jobs were visible; docs/performance.md). E2E_COMPILE=0: as then.
  [ "${E2E_COMPILE:-1}" = 1 ] && python3 -m compileall -q -j 0 /root/site "$PWD/src" "$PWD/producer" "$PWD/worker" \
    "$PWD/bench" > /dev/null 2>&1
  if [ "$wl" = chat ]; then args=(--model "$M" --dtype float16 --workload chat --n "${E2E_N:-2048}")
  else args=(--random-llama8b /root/llama8b --tokenizer-from gpu-bundle/tok --workload mixed --n "${E2E_N:-1024}"); fi
  # E2E_PYSPY=1: py-spy (carried in 1-wheels) records each worker during batch 1; E2E_ARGS: more bench flags,
  # e.g. "--lmdq-variant default --lmdq-variant whole:STREAM_FROM_NEW_TOKENS=100000" (several lmdq sides)
  local spy=(); [ "${E2E_PYSPY:-0}" = 1 ] && [ -x /root/site/bin/py-spy ] && spy=(--py-spy /root/site/bin/py-spy)
  # shellcheck disable=SC2086
  timeout $(( ${E2E_TIMEOUT:-585} - SECONDS )) python3 -m lmdq_bench e2e --backend "$backend" "${args[@]}" \
    --batches "${E2E_BATCHES:-3}" --workdir "/tmp/e2e_$name" "${spy[@]}" ${E2E_ARGS:-} -o "$OUT/e2e_$name.json" \
    > "$OUT/e2e_$name.log" 2>&1
  echo "e2e $name rc=$?"
  for f in /tmp/e2e_"$name"/worker*.log /tmp/e2e_"$name"/raw.log; do
    [ -f "$f" ] && cp "$f" "$OUT/e2e_${name}_$(basename "$f")"
  done
  # py-spy's collapsed stacks, compressed (one file each, within what comes back)
  for f in /tmp/e2e_"$name"/pyspy_*.txt; do [ -f "$f" ] && gzip -c "$f" > "$OUT/e2e_${name}_$(basename "$f").gz"; done
  grep -E "^ +[0-9]+ |first batch|^raw batch|^lmdq.* batch|^lmdq.*worker ready|Error|error" "$OUT/e2e_$name.log" | tail -24
  if [ "${E2E_PROFILE:-0}" = 1 ]; then
    python3 scripts/gpu/submit_profile.py "/tmp/e2e_$name/workload.jsonl" "$OUT/submit_profile_$name.txt" 2>&1 | tail -8
  fi
}
suite_run() {  # suite_run NAME: the suite's test files into $OUT/NAME.log
  local name=$1 i=0 g pids=() groups=()
  if [ -n "${SUITE_GROUPS:-}" ]; then
    # SUITE_GROUPS="A;B": each group (test files, space-separated) is its own pytest process, all at once on the
    # one GPU, so the suite's engine start-ups (30-55 s each, CPU-bound) overlap: the whole PyTorch suite in one
    # call. Two groups at most: each engine takes its --cache-max-entry-count (0.2-0.3) of the memory free when
    # it allocates, so two that read it at the same instant still leave room; three might not. Logs NAME_1.log,
    # NAME_2.log, ... and NAME.log (all of them, for the summary).
    IFS=';' read -r -a groups <<< "$SUITE_GROUPS"
    for g in "${groups[@]}"; do
      i=$((i + 1))
      # shellcheck disable=SC2086
      ( timeout $(( ${SUITE_TIMEOUT:-575} - SECONDS )) python3 -m pytest $g -v -s -o cache_dir=/tmp/pyc$i -rA 2>&1 \
          | grep --line-buffered -v DEBUG > "$OUT/${name}_$i.log" ) &
      pids+=($!)
    done
    wait "${pids[@]}"
    cat "$OUT/${name}"_[0-9]*.log > "$OUT/$name.log"
  else
    # shellcheck disable=SC2086
    timeout $(( ${SUITE_TIMEOUT:-575} - SECONDS )) python3 -m pytest $SUITE_FILES -v -s -o cache_dir=/tmp/pyc -rA 2>&1 \
      | grep --line-buffered -v DEBUG > "$OUT/$name.log"
  fi
  # the stage's exit status is the suite's (session 14: a green suite ended rc=1 on the MARGIN line below, a
  # red one rc=0 on its summary's grep): red if any test FAILED/ERROR or a pytest run printed no summary
  local runs; runs=$(grep -cE "^=+ .*(passed|failed|error).* in [0-9.]+s" "$OUT/$name.log")
  if grep -qE "^(FAILED|ERROR) " "$OUT/$name.log" || [ "$runs" -lt "$(( i > 0 ? i : 1 ))" ]; then suite_rc=1; fi
}
suite_rc=0
case $stage in
  e2e)
    [ "${E2E_ENV:-0}" = 1 ] && env_txt
    if [ "${E2E_BACKEND:-pytorch}" = turbomind ]; then tm_env > "$OUT/tm_env.log" 2>&1; tail -1 "$OUT/tm_env.log"; fi
    e2e "${E2E_BACKEND:-pytorch}_${E2E_WORKLOAD:-mixed}" "${E2E_BACKEND:-pytorch}" "${E2E_WORKLOAD:-mixed}"
    ;;
  tm|tmsuite|tmbench)
    tm_env > "$OUT/tm_env.log" 2>&1; tail -2 "$OUT/tm_env.log"  # not in a pipe: it exports LD_LIBRARY_PATH
    grep -E "parts:|OK|verified" "$OUT/setup_tm.log" | tail -3
    run=${TM_RUN:-none}; [ "$stage" = tmsuite ] && run=suite; [ "$stage" = tmbench ] && run=bench
    if [ "$run" = suite ]; then
      env_txt
      suite_run gpu_suite_both
      grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|turbomind (generation|all)|backend auto|progress bars as|$SUITE_NOTES" \
        "$OUT/gpu_suite_both.log" | tail -60
    elif [ "$run" = bench ]; then
      [ "${TM_BENCH:-1}" = 1 ] && EFF_TIMEOUT=${TM_EFF_TIMEOUT:-280} eff tm_turbomind 1 --backend turbomind --repeat 2 --skip-naive
      [ "${PT_BENCH:-1}" = 1 ] && EFF_TIMEOUT=${PT_EFF_TIMEOUT:-280} eff tm_pytorch 1 --backend pytorch --repeat 1 --skip-naive
      # every request streamed per token (the pre-session-5 behaviour): what streaming costs on each backend
      [ "${STREAMED_BENCH:-0}" = 1 ] && EFF_TIMEOUT=200 eff tm_turbomind_streamed 1 --backend turbomind --repeat 1 \
        --skip-naive --stream-from-new-tokens 0
      [ "${STREAMED_BENCH:-0}" = 1 ] && EFF_TIMEOUT=200 eff tm_pytorch_streamed 1 --backend pytorch --repeat 1 \
        --skip-naive --stream-from-new-tokens 0
    fi
    ;;
  bench)
    env_txt
    # the worker's default (PyTorch engine loop in its own process), with the naive baseline: ~300 s warm,
    # more on a fresh machine (session 3's first call was cut at 330 s). The in-process comparison
    # (INPROC_BENCH=1, ~180 s) and tp=2 (TP2_BENCH=1) do not fit the same 600 s call: ask for them in a
    # call of their own with TP1_BENCH=0.
    [ "${TP1_BENCH:-1}" = 1 ] && EFF_TIMEOUT=480 eff tp1 1 --repeat 2 --stream-baseline
    [ "${INPROC_BENCH:-0}" = 1 ] && EFF_TIMEOUT=200 eff tp1_inproc 1 --no-mp-engine --repeat 2 --skip-naive --stream-baseline
    [ "${TP2_BENCH:-0}" = 1 ] && EFF_TIMEOUT=240 eff tp2 2 --repeat 2 --skip-naive
    [ "${TP_CHECK:-0}" = 1 ] && { timeout 200 python3 scripts/gpu/tp_check.py /root/llama8b > "$OUT/tp_check.log" 2>&1
                                  tail -3 "$OUT/tp_check.log"; }
    ;;
  prefix)
    env_txt
    # builds /root/llama8b on a fresh machine first (as `bench` does); default sizes: 200 docs x 8 questions
    timeout $(( ${PREFIX_TIMEOUT:-585} - SECONDS )) python3 -m lmdq_bench prefix --engine lmdeploy \
      --random-llama8b /root/llama8b --tokenizer-from gpu-bundle/tok --workload /tmp/prefix_workload.jsonl \
      ${PREFIX_ARGS:-} -o "$OUT/prefix_gpu.json" > "$OUT/prefix.log" 2>&1
    echo "rc=$?"; grep -E "^(workload|lmdq|raw|path|random)" "$OUT/prefix.log" | tail -8
    ;;
  samples)  # issue 24: lmdq-bench samples, P prompts x n=8 vs the same requests one per line (SmolLM2 after `suite`)
    timeout $(( ${SAMPLES_TIMEOUT:-585} - SECONDS )) python3 -m lmdq_bench samples --engine lmdeploy --backend pytorch \
      --model "$M" --dtype float16 --prompts "${SAMPLES_PROMPTS:-1024}" --n 8 ${SAMPLES_ARGS:-} \
      -o "$OUT/samples_gpu.json" > "$OUT/samples_gpu.log" 2>&1
    echo "samples rc=$?"; grep -vE "^\{|DEBUG" "$OUT/samples_gpu.log" | tail -12
    ;;
  setup) tail -2 "$OUT/setup_$stage.log" ;;
  parity)
    timeout 400 python3 -m pytest tests/gpu/test_parity.py -v -p no:cacheprovider 2>&1 | tee "$OUT/parity.log" | tail -8
    ;;
  suite)
    env_txt
    # byte-compile first, as e2e() does and as any pip install or image does (the wheels here are installed
    # --no-compile): tests that time CLI processes (the image e2e) otherwise count ~350 module compiles a start
    [ "${SUITE_COMPILE:-1}" = 1 ] && python3 -m compileall -q -j 0 /root/site "$PWD/src" "$PWD/producer" \
      "$PWD/worker" "$PWD/bench" > /dev/null 2>&1
    suite_run gpu_suite
    grep -E "PASSED|FAILED|ERROR|passed|failed|json_schema requests|progress bars as events|$SUITE_NOTES" "$OUT/gpu_suite.log" \
      | tail -50
    # anything failed: the same tests again with the engine loop in-process, to tell mp-engine issues apart
    if [ "${RERUN:-1}" = 1 ] && [ -z "${SUITE_GROUPS:-}" ] && grep -qE "^(FAILED|ERROR)" "$OUT/gpu_suite.log"; then
      # shellcheck disable=SC2086
      LMDQ_MP_ENGINE=0 timeout 150 python3 -m pytest $SUITE_FILES --lf -v -s -o cache_dir=/tmp/pyc \
        -rA 2>&1 | grep --line-buffered -v DEBUG > "$OUT/gpu_suite_inproc_rerun.log"
      echo "--- rerun with LMDQ_MP_ENGINE=0:"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_suite_inproc_rerun.log" | tail -8
    fi
    [ "${MARGIN:-0}" = 1 ] && { timeout 200 python3 scripts/gpu/bf16_margin.py $M > "$OUT/bf16_margin.log" 2>&1
                                tail -5 "$OUT/bf16_margin.log"; }
    ;;
  faults)
    env_txt
    # what is left of the 600 s call after the host setup above (SECONDS: since this script started)
    timeout $(( ${FAULTS_TIMEOUT:-585} - SECONDS )) python3 -m pytest tests/gpu/test_faults_gpu.py -v -s -o cache_dir=/tmp/pyc -rA \
      ${FAULTS_K:+-k "$FAULTS_K"} 2>&1 | grep --line-buffered -v DEBUG > "$OUT/faults_gpu.log"
    grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|engine SIGKILLed|restarted worker|worker_sigkill" \
      "$OUT/faults_gpu.log" | tail -24
    ;;
  tp)
    timeout 330 python3 scripts/gpu/tp_check.py $M --double-heads > "$OUT/tp_check.log" 2>&1; tail -4 "$OUT/tp_check.log"
    [ "${MARGIN:-1}" = 1 ] && { timeout 240 python3 scripts/gpu/bf16_margin.py $M > "$OUT/bf16_margin.log" 2>&1; tail -5 "$OUT/bf16_margin.log"; }
    ;;
esac
exit $suite_rc

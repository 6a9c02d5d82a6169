#!/usr/bin/env bash
# Before / after in ONE device call on the lent H200: GPU tests of this tree, then the same benchmark
# sections on a baseline commit and on this tree, one after the other on the same GPU.
#
# Here, once: ../shared/device/fetch-wheels.sh platformdirs; the ShareGPT wheel and tokenizer in .cache/ (see
# gpu_suite.sh); the baseline as a tarball: git archive -o .cache/before.tar <commit>. Every side but "after" is a
# baseline: side X is .cache/X.tar (a bisection: AB_SIDES="before c1 c2 after" with .cache/c1.tar, .cache/c2.tar).
# Device call: run(command="bash benchmarks/gpu_ab.sh", carry=[".whl", ".cache"], timeout_s=600)
# Environment: AB_TESTS (pytest paths, "" skips), AB_SECTIONS (suite sections, default engine,sharegpt,prefix),
# AB_BUDGET_S (per suite run, default 150), AB_SIDES (default "before after"), AB_CMD (a benchmark command run on
# each side, given --out), AB_EXTRA (a command run after, in this tree).
set -uo pipefail
start=$SECONDS
OUT=${OUT:-/tmp/out}; R="$OUT/ab"; mkdir -p "$R"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENMILL_CACHE=/tmp/tokenmill-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install -q --no-deps --no-build-isolation -e .
[ -f .cache/smollm2-tokenizer.json ] && export TOKENMILL_LENGTH_TOKENIZER=$PWD/.cache/smollm2-tokenizer.json
# each baseline, installed (not editable) beside this tree's editable install
for side in ${AB_SIDES:-before after}; do
  [ $side = after ] && continue
  mkdir -p /tmp/$side && tar xf .cache/$side.tar -C /tmp/$side
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/${side}_site /tmp/$side 2>&1 | tail -2
done
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader | tee "$R/gpu.txt"
[ -n "${AB_SECTIONS-x}" ] && SUITE_DIR=none SUITE_BUDGET_S=1 SUITE_ARGS="--sections none" bash benchmarks/gpu_suite.sh \
  >/dev/null 2>&1  # the ShareGPT JSON into the cache, for the suite sections
if [ -n "${AB_TESTS-tests/}" ]; then
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider ${AB_TESTS:-tests/} 2>&1 | tee "$R/gpu_tests.log" \
    | grep -E "passed|failed|^FAILED|^E " | head -30
fi
echo "== tests done at $(( SECONDS - start )) s"
sections=${AB_SECTIONS-engine,sharegpt,prefix}
for side in ${AB_SIDES:-before after}; do
  if [ $side = after ]; then pp=$PYTHONPATH; else pp=/tmp/${side}_site:$PYTHONPATH; fi
  # AB_CMD: benchmark commands separated by ";;", each given --out (e.g. "python3 -m tokenmill.benchmarks.gpu_e2e
  # --batches 1,8 --fill-requests 0 ;; python3 -m tokenmill.benchmarks.broker_bench --latency-steps 2000")
  i=0
  while IFS= read -r cmd; do
    [ -z "${cmd// }" ] && continue
    i=$((i + 1)); t0=$SECONDS
    (cd /tmp && PYTHONPATH=$pp timeout ${AB_CMD_TIMEOUT:-150} $cmd --out "$R/$side-cmd$i") > "$R/$side-cmd$i.log" 2>&1
    echo "== $side cmd$i: exit $? in $(( SECONDS - t0 )) s: $cmd"; tail -${AB_CMD_TAIL:-8} "$R/$side-cmd$i.log" | cut -c1-160
  done <<< "$(echo "${AB_CMD:-}" | sed 's/;;/\n/g')"
  [ -z "$sections" ] && continue
  t0=$SECONDS
  (cd /tmp && PYTHONPATH=$pp timeout $(( ${AB_BUDGET_S:-150} + 30 )) python3 -m tokenmill.benchmarks.suite --device gpu \
     --sections "$sections" --budget-s ${AB_BUDGET_S:-150} --out "$R/$side") > "$R/$side.log" 2>&1
  echo "== $side: exit $? in $(( SECONDS - t0 )) s"
  grep -E "^\| (decode-only|new request)|TTFT p50 / p90 \(ms\), prefix|ShareGPT offline|fixed|^\| [0-9.]+ GiB" "$R/$side/suite.md" | cut -c1-200
done
if [ -n "${AB_EXTRA:-}" ]; then bash -c "$AB_EXTRA" 2>&1 | tail -40; fi
tar czf "$OUT/ab.tgz" -C "$OUT" ab && rm -rf "$R"
echo "== all done in $(( SECONDS - start )) s"

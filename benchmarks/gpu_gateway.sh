#!/usr/bin/env bash
# The gateway's added latency per token (issue 14, item 2) on the lent H200's host cores: gateway_bench with
# 64 streams behind one gateway process and behind several (--gateway-workers), in one device call. No GPU
# work: the engine is gateway_bench's paced fake; the host's 16 cores give the gateway, broker, worker and load
# generator cores of their own, which this project's 2-core machine cannot.
#
# Here, once: ../shared/device/fetch-wheels.sh platformdirs (pyzmq, structlog, gguf, platformdirs into .whl/), and
# the gateway's wheels for Python 3.12 into .whl-gw/ (git-ignored: echo /.whl-gw/ >> .git/info/exclude):
#   python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl-gw fastapi uvicorn httptools prometheus-client        # ~4 MB with their dependencies
# Device call: run(command="bash benchmarks/gpu_gateway.sh", carry=[".whl", ".whl-gw"], timeout_s=500)
# Environment: GW_WORKERS (default "1 4 8"), GW_ROUNDS (default 3), GW_TIMEOUT_S per run (default 120),
# GW_PATHS (default sdk,sse,sse_readline: the lean reader and the earlier one side by side), GW_LOAD_PROCS
# (load-generator processes per path, the same for every path; default 1).
# Results: $OUT/gw<N>/gateway_h200host_w<N>.{json,md} and summary.json; copy them to benchmarks/results/h200/.
set -uo pipefail
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl-gw/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install -q --no-deps --no-build-isolation -e .
nproc
for w in ${GW_WORKERS:-1 4 8}; do
  t0=$SECONDS
  timeout ${GW_TIMEOUT_S:-120} python3 -m tokenmill.benchmarks.gateway_bench --paths ${GW_PATHS:-sdk,sse,sse_readline} \
    --gateway-workers $w --load-procs ${GW_LOAD_PROCS:-1} --rounds ${GW_ROUNDS:-3} --record --out "$OUT/gw$w" --name gateway_h200host_w$w > "$OUT/gw$w.log" 2>&1
  echo "== gateway workers $w: exit $? in $(( SECONDS - t0 )) s"
  grep -E "Added|^\| (sdk|sse|sse_readline) " "$OUT/gw$w"/*.md 2>/dev/null | cut -c1-330 || tail -5 "$OUT/gw$w.log"
done

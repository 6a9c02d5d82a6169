#!/usr/bin/env bash
# Puts the embedded GGUF where worker/registry_fetch.py looks for it (TOKENMILL_CACHE), with its ".ok" stamp: the
# device machine has no network and one call carries at most 64 MiB, so the 98 MB file arrives in parts
# (../shared/device/stage-file.sh .../SmolLM2-135M-Instruct.Q4_1.gguf smollm2.gguf: one call per part, each
# copying its .stage/smollm2.gguf.partNN to /root/stage/, the machine kept warm between them). This script joins
# the parts found in /root/stage/ and .stage/, checks the sha256 and installs the file. Used by gpu_eagle_train.sh
# and gpu_check.sh's spec section after the project is installed.
set -euo pipefail
mkdir -p /root/stage
# A part may travel gzipped (.gz: 1.9 MB less, which can decide whether a call's carry fits beside the tree)
for part in .stage/smollm2.gguf.part*; do
  case $part in
    *.gz) gunzip -c "$part" > "/root/stage/$(basename "${part%.gz}")" ;;
    *) [ -f "$part" ] && cp "$part" /root/stage/ ;;
  esac
done
cat /root/stage/smollm2.gguf.part[0-9][0-9] > /root/stage/smollm2.gguf
python3 - <<'PY'
import hashlib, shutil
from pathlib import Path
from tokenmill.worker.registry_fetch import EMBEDDED_MODEL, cache_dir
src = Path("/root/stage/smollm2.gguf")
assert hashlib.sha256(src.read_bytes()).hexdigest() == EMBEDDED_MODEL.sha256, "the staged GGUF is not the embedded one"
dest = cache_dir() / EMBEDDED_MODEL.package / EMBEDDED_MODEL.version / Path(EMBEDDED_MODEL.member).name
dest.parent.mkdir(parents=True, exist_ok=True)
shutil.copyfile(src, dest)
Path(str(dest) + ".ok").touch()
print("embedded model:", dest)
PY

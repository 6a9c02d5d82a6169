"""GGUF Q8_0 / Q4_0 / Q4_1 run from their blocks (worker/quant/gguf.py) on the GPU, in one device call (about a
minute). Written in a CPU-only session and NOT RUN yet: its first run on the H200 is the kernels' GPU test
(they were checked under the Triton interpreter in fp16 / fp32 and by the sm_90 compile test).

1. correctness: each format's GPU path (the skinny split-K kernel for M <= 16, the tiled one above) against
   its torch reference in bf16 at Llama-3-8B shapes (norm-wise relative error; stops before timing if off);
2. kernel table: y = x @ W.T on the four Llama-3-8B projections at M = 1, 8, 32, 128, 512: bf16 cuBLAS
   (F.linear) vs each format; median ms of triton.testing.do_bench and the speed-up over bf16.
The weights are random blocks made on the GPU (random nibbles / int8 and fp16 scales of a realistic size): the
kernels' speed does not depend on the values, and the reference checks whatever they hold.

    python -m tokenmill.benchmarks.gpu_gguf --out benchmarks/results/h200
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.benchmarks.common import write_results
from tokenmill.benchmarks.gpu_quant import ROWS, SHAPES

QTYPES = ("q8_0", "q4_0", "q4_1")


def random_blocks(qtype: str, n: int, k: int, dev: torch.device, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, k / 32 * block bytes]: ggml blocks with random bits and fp16 scales (d, and Q4_1's m = -8 d)
    that make y = x @ W.T of O(1) for unit-normal x."""
    from tokenmill.worker.quant.gguf import BLOCK, BLOCK_BYTES

    size, nb = BLOCK_BYTES[qtype], k // BLOCK
    rows = torch.randint(0, 256, (n, nb, size), dtype=torch.uint8, device=dev, generator=gen)
    levels = 64.0 if qtype == "q8_0" else 4.0
    d = (torch.rand(n, nb, 1, device=dev, generator=gen) + 0.5) / (k**0.5 * levels)
    rows[:, :, 0:2] = d.half().view(torch.uint8)
    if qtype == "q4_1":
        rows[:, :, 2:4] = (-8 * d).half().view(torch.uint8)
    return rows.reshape(n, nb * size)


def gguf_layers(n: int, k: int, dev: torch.device) -> dict[str, Any]:
    """A bf16 Linear of each format holding random blocks of an [n, k] weight."""
    from tokenmill.worker.models.layers import Linear
    from tokenmill.worker.quant.gguf import GgufLinearMethod, repack_blocks

    gen = torch.Generator(device=dev).manual_seed(n + k)
    layers = {}
    for qtype in QTYPES:
        method = GgufLinearMethod(qtype)
        layer = Linear(k, n, False, method, dtype=torch.bfloat16, device=dev)
        for name, t in repack_blocks(random_blocks(qtype, n, k, dev, gen), qtype).items():
            method.load_weight(layer, name, t, None)
        layers[qtype] = layer
    return layers


def each_shape(dev: torch.device) -> Iterator[tuple[str, int, int, dict[str, Any]]]:
    """(projection, N, K, a layer of each format) for the Llama-3-8B shapes, one shape in memory at a time."""
    for proj, (n, k) in SHAPES.items():
        layers = gguf_layers(n, k, dev)
        yield proj, n, k, layers
        del layers
        torch.cuda.empty_cache()


def check_kernels(dev: torch.device) -> dict[str, dict[str, float]]:
    from tokenmill.kernels.quant_weight import quant_matmul_ref

    errors: dict[str, dict[str, float]] = {}
    for proj, _, k, layers in each_shape(dev):
        for m in (1, 16, 128):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            for qtype, layer in layers.items():
                ref = quant_matmul_ref(x.float(), layer.method.packed(layer))
                err = float((layer(x).float() - ref).norm() / ref.norm())
                errors.setdefault(qtype, {})[f"{proj}_m{m}"] = err
                if err > 2e-2:
                    raise AssertionError(f"{qtype} {proj} M={m}: relative error {err:.3e} vs the reference")
    return errors


def kernel_table(dev: torch.device) -> list[dict[str, Any]]:
    """Median ms of bf16 F.linear (a random dense weight of the shape) and of each format's layer, per M."""
    from triton.testing import do_bench

    def ms(fn: Callable[..., Any], *args: Any) -> float:
        return float(do_bench(lambda: fn(*args), return_mode="median"))

    rows = []
    for proj, n, k, layers in each_shape(dev):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row: dict[str, Any] = {"proj": proj, "m": m, "n": n, "k": k, "bf16_ms": ms(F.linear, x, w)}
            row |= {f"{q}_ms": ms(layer, x) for q, layer in layers.items()}
            row |= {f"{q}_speedup": row["bf16_ms"] / row[f"{q}_ms"] for q in layers}
            rows.append(row)
            print(row, flush=True)
    return rows


def table_md(payload: dict[str, Any]) -> str:
    lines = ["| proj | M | bf16 cuBLAS ms | " + " | ".join(f"{q.upper()} ms (x)" for q in QTYPES) + " |",
             "|---|---|---|" + "---|" * len(QTYPES)]
    for r in payload["kernels"]:
        cells = " | ".join(f"{r[q + '_ms']:.4f} ({r[q + '_speedup']:.2f}x)" for q in QTYPES)
        lines.append(f"| {r['proj']} | {r['m']} | {r['bf16_ms']:.4f} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/h200"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    payload: dict[str, Any] = {"benchmark": "gpu_gguf", "shapes": "Llama-3-8B (N, K)", "rows": list(ROWS)}
    payload["errors"] = check_kernels(dev)
    payload["kernels"] = kernel_table(dev)
    write_results(args.out, "gpu_gguf", payload, table_md(payload))


if __name__ == "__main__":
    main()

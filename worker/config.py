"""Frozen configuration of one engine. Runtime facts (blocks found, memory used) never go in here:
they travel in `EngineStats` and in the messages a worker sends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tokenmill.kernels.config import KernelConfig
from tokenmill.protocol.sampling import MAX_SPECULATIVE_TOKENS

LoadFormat = Literal["auto", "hf", "gguf", "dummy"]
DType = Literal["auto", "float32", "float16", "bfloat16"]
Quantization = Literal["auto", "int8", "int4", "fp8"]
GgufNative = Literal["auto", "on", "off"]
KVCacheDType = Literal["auto", "fp8"]
KVCacheRotation = Literal["none", "hadamard"]


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 style ("llama3") frequency scaling; `kind="none"` disables it."""

    kind: Literal["none", "llama3", "linear"] = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelArch:
    """Shape and flavour of a Llama-family decoder; enough to build the module and check weights."""

    arch: Literal["llama", "mistral", "qwen2", "qwen3"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2/2.5
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rope
    sliding_window: int | None = None  # Mistral v0.1
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelArch.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError("sliding_window must be positive or None")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. On CUDA the size comes from `gpu_memory_utilization` of total device memory
    minus what weights and a worst-case step take; on CPU from `cpu_kv_bytes`. `num_blocks` overrides both."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    cpu_kv_bytes: int = 1 << 30
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.cpu_kv_bytes <= 0:
            raise ValueError("cpu_kv_bytes must be positive")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    """One step computes at most `max_num_batched_tokens` tokens of at most `max_num_seqs` requests."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    policy: Literal["fcfs", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True
    # A prefill chunk longer than this is cut even when the budget allows more (0: no extra cap).
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}")


SpeculativeMethod = Literal["off", "ngram", "eagle"]


MAX_TREE_WIDTH = 8  # n-gram: different continuations one tree merges; eagle: nodes per tree level


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each step a proposer drafts up to `num_speculative_tokens` tokens per request and
    one target forward verifies them (worker/spec/). "ngram": prompt lookup, the tokens that followed the latest
    earlier occurrence of the request's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`).
    "eagle": an EAGLE draft head (worker/spec/eagle.py: EAGLE-1, or with EAGLE-3's layer fusion) from the folder
    `draft_model` (None: the head shipped for the model, if there is one; ignored by the other methods). A
    request's `num_speculative_tokens` overrides k (0: off for it).
    `tree_width` > 1: a tree of at most k nodes, verified in one forward (worker/spec/tree.py); 1: one chain.
    ngram: up to that many different continuations (earlier occurrences of the suffix) merged; eagle: the head's
    top-`tree_width` expansion per level, the k best nodes by cumulative log-prob (worker/spec/eagle_tree.py).
    `auto_switch` (None: on for CUDA) turns speculation off while the batch is large enough that a verify
    step costs more than the tokens it gains (worker/spec/switch.py, costs measured at start-up).
    `eagle_lookup_min` n > 0 (eagle chains): a request whose last n..prompt_lookup_max tokens occur earlier in its
    own tokens takes prompt lookup's drafts in that step, the others the head's (a one-layer head copies poorly,
    lookup copies exactly); 0: the head alone."""

    method: SpeculativeMethod = "off"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 8
    prompt_lookup_min: int = 1
    draft_model: str | None = None
    auto_switch: bool | None = None
    tree_width: int = 1
    eagle_lookup_min: int = 0

    def __post_init__(self) -> None:
        if self.eagle_lookup_min and not 1 <= self.eagle_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"eagle_lookup_min must be 0 (off) or in [1, prompt_lookup_max = "
                             f"{self.prompt_lookup_max}], got {self.eagle_lookup_min}")
        if self.eagle_lookup_min and self.tree_width > 1:
            raise ValueError("eagle_lookup_min (prompt lookup before the head) drafts chains: use tree_width 1")
        if self.method not in ("off", "ngram", "eagle"):
            raise ValueError(f"unknown speculative method {self.method!r}; use off, ngram or eagle")
        if not 1 <= self.tree_width <= MAX_TREE_WIDTH:
            raise ValueError(f"tree_width must be in [1, {MAX_TREE_WIDTH}], got {self.tree_width}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from. `model` is a HF folder, a .gguf file, a dummy shape name
    (with load_format="dummy") or "embedded" (the packaged SmolLM2-135M-Instruct)."""

    model: str = "embedded"
    load_format: LoadFormat = "auto"
    dtype: DType = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    # Triton backend: decode-only steps rotate q/k and write the KV cache inside the attention kernel
    # (False: a separate rotary + cache-write kernel first).
    decode_rope_in_attention: bool = True
    cuda_graphs: bool = True  # decode-only steps replay captured graphs (CUDA only)
    # with cuda_graphs: steps with prompt tokens (up to max_num_batched_tokens) replay piecewise graphs, attention
    # launched between the pieces (CUDA, Triton backend)
    piecewise_graphs: bool = True
    # with piecewise_graphs: steps of up to 2,048 tokens whose attention launch was captured (tile choice and a
    # power-of-two key split count) replay a whole-step graph, attention inside (worker/cuda_graphs.py
    # WholeStepGraphs); the others replay the pieces. On by default: on the H200 it took the host launch of a mixed
    # step from 1.8-3.1 to 1.1-1.3 ms, greedy tokens equal to the pieces' (benchmarks/results/h200/NOTES.md)
    whole_step_graphs: bool = True
    # Schedule step N+1 while step N runs on the device (one step in flight). None: on for CUDA only.
    async_scheduling: bool | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)  # process-wide: set by the model runner
    # decoder-layer projections: "auto" = the checkpoint's own format (dense, or its quantization_config);
    # int8 / int4 / fp8 quantize a dense checkpoint on load (worker/quant/)
    quantization: Quantization = "auto"
    kv_cache_dtype: KVCacheDType = "auto"  # "auto": the model dtype; "fp8": e4m3 (needs an FP8 GPU)
    # fp8 caches only: "hadamard" rotates keys (after rotary, queries alike) and values by an orthonormal Hadamard
    # matrix before they are cached, and the attention output back (worker/attention/kv_rotation.py)
    kv_cache_rotation: KVCacheRotation = "none"
    # ranks (one process and device each) the model's heads, MLP columns and vocabulary are split over
    # (worker/parallel/); the broker still sees one worker
    tensor_parallel_size: int = 1
    # GGUF Q8_0 / Q4_0 / Q4_1 projections run from their blocks (worker/quant/gguf.py) or are dequantized on
    # load: "auto" = native on CUDA, dequantized on the CPU
    gguf_native: GgufNative = "auto"

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "hf", "gguf", "dummy"):
            raise ValueError(f"unknown load_format {self.load_format!r}; use auto, hf, gguf or dummy")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}; use auto, torch or triton")
        if self.quantization not in ("auto", "int8", "int4", "fp8"):
            raise ValueError(f"unknown quantization {self.quantization!r}; use auto, int8, int4 or fp8")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; use auto or fp8")
        if self.kv_cache_rotation not in ("none", "hadamard"):
            raise ValueError(f"unknown kv_cache_rotation {self.kv_cache_rotation!r}; use none or hadamard")
        if self.kv_cache_rotation != "none" and self.kv_cache_dtype != "fp8":
            # exact in real arithmetic: over a cache of the model dtype it would only cost time
            raise ValueError(f"--kv-cache-rotation {self.kv_cache_rotation} changes only an fp8 KV cache's rounding: "
                             "use it with --kv-cache-dtype fp8, or --kv-cache-rotation none")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.tensor_parallel_size > 1 and self.speculative.method == "eagle":
            # the head drafts through the target's embedding and LM head, which TP splits by vocabulary
            raise ValueError("--speculative eagle does not run with --tensor-parallel-size > 1 yet (ngram does)")
        if self.gguf_native not in ("auto", "on", "off"):
            raise ValueError(f"unknown gguf_native {self.gguf_native!r}; use auto, on or off")
        if self.tensor_parallel_size > 1 and self.gguf_native == "on":
            raise ValueError("--gguf-native on does not split GGUF blocks over tensor-parallel ranks: use auto or off "
                             "(the ranks dequantize them)")

"""Triton kernels of the engine. Import launchers from their modules (names deliberately not re-exported
here: several modules share their launcher's name, and a package-level re-export would shadow the module
for `import tokenmill.kernels.rmsnorm as m`):

    tokenmill.kernels.paged_attention   paged_attention, PagedAttentionConfig, choose_num_splits
    tokenmill.kernels.kv_cache          write_kv_cache
    tokenmill.kernels.rotary            rotary_embedding, rotary_and_cache, cos_sin_cache_from_inv_freq
    tokenmill.kernels.attention_ref     paged_attention_ref, write_kv_cache_ref, rotary_embedding_ref (plain
                                        torch, no Triton; rotary_and_cache = the last two)
    tokenmill.kernels.rmsnorm           rmsnorm, add_rmsnorm (+ _ref)
    tokenmill.kernels.activation        silu_and_mul, silu_and_mul_ref
    tokenmill.kernels.gemv              skinny_matmul, add_rmsnorm_matmul, silu_mul_matmul (+ _ref), SkinnyConfig
    tokenmill.kernels.quant_weight      PackedWeight (INT8 / INT4 layout), pack_int4, quant_matmul_ref,
                                        quantize_fp8_rows, fp8_matmul_ref (plain torch)
    tokenmill.kernels.quant_gemv        quant_skinny_matmul, quant_add_rmsnorm_matmul, quant_silu_mul_matmul (+ _ref)
    tokenmill.kernels.quant_gemm        quant_matmul (tiled, any M), GemmConfig
    tokenmill.kernels.fp8_gemv          fp8_skinny_matmul, fp8_add_rmsnorm_matmul, fp8_silu_mul_matmul (+ _ref)
    tokenmill.kernels.tuned             QuantSkinnyConfig, GemmConfig, the per-device tuned tables (configs/*.json)

    tokenmill.kernels.config            KernelConfig, configure (process-wide settings, e.g. PDL)

Each launcher checks shapes, dtypes, devices and strides (ValueError) and has a plain-torch `*_ref` twin
(those of the attention path in attention_ref.py, which the CPU worker runs).
Importing this package (or `kernels.config`) imports neither torch nor Triton (the optional `gpu` extra) and
changes nothing; the kernel modules do import them. On a machine without CUDA, the first kernel module
imported turns Triton's interpreter on (kernels/launch.py, `choose_interpreter`).
"""

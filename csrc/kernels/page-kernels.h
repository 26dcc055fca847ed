// page-kernels.h — page-local's CPU kernels (csrc/kernels/), called from ggml-cpu's own files.
//
// The sources are compiled into ggml-cpu itself (CMakeLists.txt: target_sources(ggml-cpu ...)), so they get
// exactly ggml-cpu's flags (-march=native -mno-amx-*, -O3, its defines) and the generated code is what it was
// when it sat inline in ops.cpp / ggml-cpu.c. The upstream files only hold call sites:
//   csrc/patches/04-decode-kernel.patch    ops.cpp: the one-token split-KV path      -> page-fa-decode.cpp
//                                          ops.cpp: 2..63 query rows                 -> page-fa-decode.cpp
//   csrc/patches/05-prefill-kernels.patch  ops.cpp: the tiled prompt kernel          -> page-fa-tile.cpp
//                                          ggml-cpu.c: the mul_mat chunk loop        -> page-matmul.c
//                                          arch/x86/quants.c: #include of page-q4_1-x86.inc
// Each kernel has a switch that restores llama.cpp's own code bit for bit:
//   $PAGE_LOCAL_FA_KERNEL=llama.cpp   the decode kernel and the tile conversions (page_fa_enabled)
//   $PAGE_LOCAL_MATMUL=llama.cpp      the Q4_1 prefill matmul (read once)
#pragma once

#include "ggml.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
// --- flash attention (C++, called from ops.cpp) ---------------------------------------------------------------

// false when $PAGE_LOCAL_FA_KERNEL=llama.cpp (read at every call, as before the move)
bool page_fa_enabled(void);

// One-token decode over an F16 or quantized K/V cache, cells [ic_start, ic_end) of the split-KV path: writes
// this chunk's partials (M, S, VKQ per query head) as ggml_compute_forward_flash_attn_ext_f16_one_chunk does.
// Returns false (nothing written) for a case it does not cover; the caller then runs llama.cpp's kernel.
bool page_fa_decode_chunk(const ggml_tensor * dst, int64_t ic_start, int64_t ic_end,
                          float * partials, int64_t partial_stride);

// 2..63 query rows (a short message, the check's forced chunk; the tiled kernel starts at 64): thread ith of nth
// takes its share of (KV head, query row) pairs and writes their normalised output to dst, each row as the decode
// kernel computes one over every cell (masked cells skipped). Returns false (nothing written) for a case it does
// not cover; every thread decides the same, and the caller then runs llama.cpp's per-row kernel.
bool page_fa_rows(const ggml_tensor * dst, int ith, int nth);

// The tiled prompt kernel's mask tile: rows [0, tile_rows) of query rows iq1.. of head iq2 (stream iq3), cells
// [ic, ic + kv_tile), times slope, into mask32 (row stride KV_TILE), padded with -inf to KV_TILE; bit for bit
// llama.cpp's loop. Returns whether every entry is -inf (the tile can be skipped).
bool page_fa_tile_mask(const ggml_tensor * mask, int iq1, int iq2, int iq3, int64_t ic, int tile_rows,
                       int kv_tile, float slope, float * mask32, int KV_TILE);

// The tiled prompt kernel's K tile, packed transposed (K_f32[dk*KV_TILE + tk]): an F16 row converted with
// ggml's vector F16->F32 (exact), a quantized row (q8_0, q4_0, ...) dequantized with ggml's to_float.
// Returns false (nothing written) for F32 or a head larger than 256; the caller then runs llama.cpp's loop.
bool page_fa_tile_k(const ggml_tensor * k, int64_t ic, int kv_tile, int ik2, int ik3, float * K_f32, int KV_TILE);

// simd_gemm (simd-gemm.h) with the rows left after its 6-row blocks taken four at a time; bit for bit simd_gemm.
void page_simd_gemm(float * GGML_RESTRICT C, const float * GGML_RESTRICT A, const float * GGML_RESTRICT B,
                    int M, int K, int N);

extern "C" {
#endif

// --- Q4_1 prefill matmul (C, called from ggml-cpu.c) ------------------------------------------------------------

// ggml_compute_forward_mul_mat_one_chunk's rows [ir0_start, ir0_end) x columns [ir1_start, ir1_end) for a 2-D
// Q4_1 weight and 4 or more tokens: four tokens per pass over each weight row (x86 with AVX2), bit for bit
// llama.cpp's loop. wdata/row_size: the activations as Q8_1 rows (src1_rows_packed: one row after another).
// Returns false (nothing written) when it does not apply or $PAGE_LOCAL_MATMUL=llama.cpp.
bool page_mul_mat_q4_1(struct ggml_tensor * dst, enum ggml_type type, int64_t num_rows_per_vec_dot,
                       bool src1_rows_packed, const void * wdata, size_t row_size,
                       int64_t ir0_start, int64_t ir0_end, int64_t ir1_start, int64_t ir1_end);

// One Q4_1 weight row against four Q8_1 rows: s[c*bs] = row . (vy + c*by bytes), c = 0..3. Defined in
// page-q4_1-x86.inc, which arch/x86/quants.c includes (it uses that file's static helpers).
void ggml_page_vec_dot_q4_1_q8_1_x4(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                                    const void * GGML_RESTRICT vy, size_t by);

#ifdef __cplusplus
}
#endif

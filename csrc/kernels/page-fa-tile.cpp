// page-fa-tile.cpp — page-local's parts of ggml-cpu's tiled flash-attention prompt kernel (docs/design.md §6.2).
//
// Compiled into ggml-cpu with ggml-cpu's flags (CMakeLists.txt); called from ggml_compute_forward_flash_attn_ext_tiled
// in ggml-cpu/ops.cpp by csrc/patches/05-prefill-kernels.patch. Moved here unchanged from inside ops.cpp.
// The tile's mask and K rows are converted with ggml's vector F16->F32 (bit for bit the scalar lookups), the mask
// is scaled only when ALiBi sets a slope (1*x == x) and tested for "all masked" with one vector maximum, a
// quantized cache (q8_0, q4_0, ...) is dequantized row by row into the tile, and the GEMMs' last rows are taken four
// at a time (page_simd_gemm, bit for bit simd_gemm). The GEMMs, softmax and accumulation stay llama.cpp's, so the
// logits are bit-identical to llama.cpp's for F16 caches. $PAGE_LOCAL_FA_KERNEL=llama.cpp keeps llama.cpp's loops.

#include "page-kernels.h"

#include "ggml-cpu.h"
#include "simd-gemm.h"
#include "simd-mappings.h"
#include "vec.h"

#include <cmath>

// simd_gemm (simd-gemm.h) with the rows left after the 6-row blocks taken four at a time instead of one
// at a time (a 64-row tile is 10 blocks of 6 and 4 rows: the one-row kernel loads two B vectors per two FMAs).
// Each C element is still its own FMA chain over K in the same order, so the result is bit for bit simd_gemm's.
void page_simd_gemm(float * GGML_RESTRICT C, const float * GGML_RESTRICT A, const float * GGML_RESTRICT B,
                    int M, int K, int N) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    static constexpr int KN = GGML_F32_EPR;
    const int full = M - M % GEMM_RM;
    if (full > 0) {
        simd_gemm(C, A, B, full, K, N);
    }
    int64_t ii = full;
    if (ii + 4 <= M) {
        const float * A4 = A + ii*K;
        float * C4 = C + ii*N;
        int64_t jj = 0;
        for (; jj + GEMM_RN * KN <= N; jj += GEMM_RN * KN) {
            simd_gemm_ukernel<4, GEMM_RN>(C4 + jj, A4, B + jj, K, N);
        }
        for (; jj + KN <= N; jj += KN) {
            simd_gemm_ukernel<4, 1>(C4 + jj, A4, B + jj, K, N);
        }
        if (jj < N) {
            simd_gemm_ukernel_tail<4>(C4 + jj, A4, B + jj, K, N, N - jj);
        }
        ii += 4;
    }
    if (ii < M) {
        simd_gemm(C + ii*N, A + ii*K, B, M - ii, K, N);
    }
#else
    simd_gemm(C, A, B, M, K, N);
#endif
}

bool page_fa_tile_mask(const ggml_tensor * mask, int iq1, int iq2, int iq3, int64_t ic, int tile_rows,
                       int kv_tile, float slope, float * mask32, int KV_TILE) {
    bool can_skip = true;
    for (int tq = 0; tq < tile_rows; tq++) {
        const ggml_fp16_t * mp_row = (const ggml_fp16_t *)((const char *) mask->data + (iq1 + tq)*mask->nb[1] + (iq2%mask->ne[2])*mask->nb[2] + (iq3%mask->ne[3])*mask->nb[3]);
        // the row converted with ggml's vector F16->F32 (exact, as the scalar conversion), scaled only when ALiBi
        // sets a slope (1*x == x), tested with one max
        float * mrow = mask32 + tq * KV_TILE;
        ggml_cpu_fp16_to_fp32(mp_row + ic, mrow, kv_tile);
        if (slope != 1.0f) {
            ggml_vec_scale_f32(kv_tile, mrow, slope);
        }
        if (can_skip) {
            float mx = -INFINITY;
            ggml_vec_max_f32(kv_tile, &mx, mrow);
            can_skip = mx == -INFINITY;
        }
        // Pad remaining mask entries with -inf
        for (int tk = kv_tile; tk < KV_TILE; tk++) {
            mrow[tk] = -INFINITY;
        }
    }
    return can_skip;
}

bool page_fa_tile_k(const ggml_tensor * k, int64_t ic, int kv_tile, int ik2, int ik3, float * K_f32, int KV_TILE) {
    const int64_t DK = k->ne[0];
    const ggml_type kv_type = k->type;
    const bool f16 = kv_type == GGML_TYPE_F16;
    const ggml_to_float_t to_f32 = f16 || kv_type == GGML_TYPE_F32 ? nullptr : ggml_get_type_traits(kv_type)->to_float;
    if (DK > 256 || (!f16 && !to_f32)) {
        return false;
    }
    float krow[256];
    for (int tk = 0; tk < kv_tile; tk++) {
        const char * k_data = (const char *)k->data + (ic + tk)*k->nb[1] + ik2*k->nb[2] + ik3*k->nb[3];
        if (f16) {
            ggml_cpu_fp16_to_fp32((const ggml_fp16_t *)k_data, krow, DK);  // exact, as GGML_CPU_FP16_TO_FP32
        } else {
            to_f32(k_data, krow, DK);  // a quantized cache (q8_0, q4_0, ...)
        }
        for (int64_t dk = 0; dk < DK; dk++) {
            K_f32[dk * KV_TILE + tk] = krow[dk];
        }
    }
    return true;
}

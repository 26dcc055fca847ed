// page-matmul.c — page-local's Q4_1 prefill matmul loop for ggml-cpu (docs/design.md §6.2).
//
// Compiled into ggml-cpu with ggml-cpu's flags (CMakeLists.txt); called at the top of
// ggml_compute_forward_mul_mat_one_chunk in ggml-cpu/ggml-cpu.c by csrc/patches/05-prefill-kernels.patch. Moved
// here unchanged from inside that function. The per-row kernel, ggml_page_vec_dot_q4_1_q8_1_x4, is in
// page-q4_1-x86.inc (arch/x86/quants.c includes it).
//
// ggml-cpu's fast GEMM paths (tinyBLAS, the repacked and tiled kernels) do not take Q4_1, so llama.cpp computes
// every output of a prompt's matmul with its own dot product, unpacking each weight block and converting its scales
// once per token. This loop takes one weight row against four tokens per pass instead, in llama.cpp's blocks of
// 16 x 16; each output is computed with exactly llama.cpp's operations in its order, so it is bit-identical to the
// loop it replaces. $PAGE_LOCAL_MATMUL=llama.cpp (read once) keeps llama.cpp's loop.

#include "page-kernels.h"

#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "quants.h"

#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
static int page_matmul_enabled(void) {
    static int enabled = -1;
    if (enabled < 0) {
        const char * e = getenv("PAGE_LOCAL_MATMUL");
        enabled = !(e && strcmp(e, "llama.cpp") == 0);
    }
    return enabled;
}
#endif

bool page_mul_mat_q4_1(struct ggml_tensor * dst, enum ggml_type type, int64_t num_rows_per_vec_dot,
                       bool src1_rows_packed, const void * wdata, size_t row_size,
                       int64_t ir0_start, int64_t ir0_end, int64_t ir1_start, int64_t ir1_end) {
#if defined(__AVX2__)
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];
    if (!(type == GGML_TYPE_Q4_1 && num_rows_per_vec_dot == 1 && src0->ne[2] == 1 && src0->ne[3] == 1 &&
          src1->ne[2] == 1 && src1->ne[3] == 1 && src1_rows_packed && ir1_end - ir1_start >= 4 &&
          page_matmul_enabled())) {
        return false;
    }
    const int64_t ne00 = src0->ne[0];
    const size_t  nb01 = src0->nb[1];
    const size_t  nb1  = dst->nb[1];
    // llama.cpp's block-tiling (ggml_compute_forward_mul_mat_one_chunk)
    const int64_t blck_0 = 16;
    const int64_t blck_1 = 16;
    for (int64_t iir1 = ir1_start; iir1 < ir1_end; iir1 += blck_1) {
        const int64_t e1 = MIN(iir1 + blck_1, ir1_end);
        for (int64_t iir0 = ir0_start; iir0 < ir0_end; iir0 += blck_0) {
            const int64_t e0 = MIN(iir0 + blck_0, ir0_end);
            int64_t ir1 = iir1;
            for (; ir1 + 4 <= e1; ir1 += 4) {
                const char * src1_col = (const char *) wdata + ir1*row_size;
                float * dst_col = (float *) ((char *) dst->data + ir1*nb1);
                for (int64_t ir0 = iir0; ir0 < e0; ++ir0) {
                    ggml_page_vec_dot_q4_1_q8_1_x4(ne00, dst_col + ir0, nb1/sizeof(float), (const char *) src0->data + ir0*nb01, src1_col, row_size);
                }
            }
            for (; ir1 < e1; ++ir1) {
                const char * src1_col = (const char *) wdata + ir1*row_size;
                float * dst_col = (float *) ((char *) dst->data + ir1*nb1);
                for (int64_t ir0 = iir0; ir0 < e0; ++ir0) {
                    ggml_vec_dot_q4_1_q8_1(ne00, dst_col + ir0, 0, (const char *) src0->data + ir0*nb01, 0, src1_col, 0, 1);
                }
            }
        }
    }
    return true;
#else
    (void) dst; (void) type; (void) num_rows_per_vec_dot; (void) src1_rows_packed; (void) wdata; (void) row_size;
    (void) ir0_start; (void) ir0_end; (void) ir1_start; (void) ir1_end;
    return false;
#endif
}

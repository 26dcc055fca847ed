// page-fa-decode.cpp — page-local's one-token flash-attention decode kernel for ggml-cpu (docs/design.md §6.1).
//
// Compiled into ggml-cpu with ggml-cpu's flags (CMakeLists.txt); called from ggml_compute_forward_flash_attn_ext_f16
// in ggml-cpu/ops.cpp, on its split-KV path (one query row, a chunk of the cache per thread), by
// csrc/patches/04-decode-kernel.patch. Moved here unchanged from inside ops.cpp.
//
// One-token decode over an F16 K/V cache, a chunk of the KV length per thread (flash-decoding), written for the
// CPU's vector units. Per block of cells it scores each K row once for all the query heads that share it (GQA)
// with F32 dots, takes the block's maximum and its exponentials in one vector pass, and accumulates V in F32. On
// x86 with AVX2/F16C/FMA (page_fa_kq4, page_fa_pv) K and V are converted in registers as they are read, four
// cells' scores share one horizontal reduction and V is accumulated for several heads per load; elsewhere, and for
// a quantized cache (q8_0, q4_0: rows dequantized with ggml's to_float), each row is converted to F32 once per
// block. llama.cpp's kernel (ggml_compute_forward_flash_attn_ext_f16_one_chunk) converts, exponentiates and
// rescales once per cell and per head, in F16, and is 1.2-2.6x slower than the unfused KQ/softmax/KQV path at
// 1K-8K cells on 2-core x86. Writes the same partials (M, S, VKQ) the reduction across threads reads.
//
// The same row computation serves 2..63 query rows (page_fa_rows): a short message read over a long conversation,
// and the verify check's forced chunks of 4, 8, 16... tokens. llama.cpp runs those through one_chunk, one query
// head and one row at a time over every cell (its tiled kernel starts at 64 rows), at about three decode steps per
// token when every cell is visible; here each (KV head, row) pair is one pass over the cells, the G query heads
// sharing each K and V load, the whole range in one thread (no partials).
// $PAGE_LOCAL_FA_KERNEL=llama.cpp restores llama.cpp's own decode path bit for bit (tests replay rows with it).

#include "page-kernels.h"

#include "ggml-cpu.h"
#include "simd-mappings.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#endif

bool page_fa_enabled(void) {
    const char * e = getenv("PAGE_LOCAL_FA_KERNEL");
    return !(e && strcmp(e, "llama.cpp") == 0);
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
// The decode kernel's inner loops on x86 (AVX2, F16C, FMA). Scores of four consecutive cells for NG
// query heads: out[h*ostride + c] = Q[h] . K[c] + mask[c], K read as F16 from the cache (row stride kstride bytes).
#if defined(__AVX512F__)
// 16 lanes per FMA where ggml-cpu is built with AVX-512 (DK, DV multiples of 16): on an AMD EPYC Zen 4, SmolLM2 at 4K
// cells, a decode step 38.6 / 37.1 ms against 44.6 / 48.9 with the 8-lane loops (1 thread, two alternated runs;
// llama.cpp's kernel 35.7 there). $PAGE_LOCAL_FA_512=0 (read once, when the library loads) keeps the 8-lane loops.
static const bool page_fa_512 = getenv("PAGE_LOCAL_FA_512") == nullptr || strcmp(getenv("PAGE_LOCAL_FA_512"), "0") != 0;

// The four cells' 16-lane sums are folded to 8 lanes and reduced as the AVX2 version does.
template <int NG>
static inline void page_fa_kq4_512(const float * Q, int64_t DK, const char * k0, size_t kstride, const float * mask,
                                   float * out, int64_t ostride) {
    __m512 a[NG][4];
    for (int h = 0; h < NG; ++h) {
        for (int c = 0; c < 4; ++c) {
            a[h][c] = _mm512_setzero_ps();
        }
    }
    for (int64_t d = 0; d < DK; d += 16) {
        __m512 kv[4];
        for (int c = 0; c < 4; ++c) {
            kv[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (k0 + c*kstride + d*sizeof(ggml_fp16_t))));
        }
        for (int h = 0; h < NG; ++h) {
            const __m512 qv = _mm512_loadu_ps(Q + h*DK + d);
            for (int c = 0; c < 4; ++c) {
                a[h][c] = _mm512_fmadd_ps(qv, kv[c], a[h][c]);
            }
        }
    }
    const __m128 m = _mm_loadu_ps(mask);
    for (int h = 0; h < NG; ++h) {
        __m256 b[4];
        for (int c = 0; c < 4; ++c) {
            b[c] = _mm256_add_ps(_mm512_castps512_ps256(a[h][c]),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[h][c]), 1)));
        }
        const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]), _mm256_hadd_ps(b[2], b[3]));
        _mm_storeu_ps(out + h*ostride, _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)), m));
    }
}

template <int NG>
static inline void page_fa_pv_512(float * acc, int64_t DV, const float * p, int64_t pstride, const char * v0,
                                  size_t vstride, const bool * live, int64_t n) {
    for (int64_t d = 0; d < DV; d += 16) {
        __m512 a[NG];
        for (int h = 0; h < NG; ++h) {
            a[h] = _mm512_loadu_ps(acc + h*DV + d);
        }
        for (int64_t j = 0; j < n; ++j) {
            if (!live[j]) {
                continue;
            }
            const __m512 vv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (v0 + j*vstride + d*sizeof(ggml_fp16_t))));
            for (int h = 0; h < NG; ++h) {
                a[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h*pstride + j]), vv, a[h]);
            }
        }
        for (int h = 0; h < NG; ++h) {
            _mm512_storeu_ps(acc + h*DV + d, a[h]);
        }
    }
}
#endif

template <int NG>
static inline void page_fa_kq4(const float * Q, int64_t DK, const char * k0, size_t kstride, const float * mask,
                               float * out, int64_t ostride) {
#if defined(__AVX512F__)
    if (DK % 16 == 0 && page_fa_512) {
        page_fa_kq4_512<NG>(Q, DK, k0, kstride, mask, out, ostride);
        return;
    }
#endif
    __m256 a[NG][4];
    for (int h = 0; h < NG; ++h) {
        for (int c = 0; c < 4; ++c) {
            a[h][c] = _mm256_setzero_ps();
        }
    }
    for (int64_t d = 0; d < DK; d += 8) {
        __m256 kv[4];
        for (int c = 0; c < 4; ++c) {
            kv[c] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (k0 + c*kstride + d*sizeof(ggml_fp16_t))));
        }
        for (int h = 0; h < NG; ++h) {
            const __m256 qv = _mm256_load_ps(Q + h*DK + d);
            for (int c = 0; c < 4; ++c) {
                a[h][c] = _mm256_fmadd_ps(qv, kv[c], a[h][c]);
            }
        }
    }
    const __m128 m = _mm_loadu_ps(mask);
    for (int h = 0; h < NG; ++h) {
        const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[h][0], a[h][1]), _mm256_hadd_ps(a[h][2], a[h][3]));
        _mm_storeu_ps(out + h*ostride, _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)), m));
    }
}

// acc[h*DV ..] += sum over live cells j of p[h*pstride + j] * V[j], V read as F16 from the cache, for NG heads
template <int NG>
static inline void page_fa_pv(float * acc, int64_t DV, const float * p, int64_t pstride, const char * v0,
                              size_t vstride, const bool * live, int64_t n) {
#if defined(__AVX512F__)
    if (DV % 16 == 0 && page_fa_512) {
        page_fa_pv_512<NG>(acc, DV, p, pstride, v0, vstride, live, n);
        return;
    }
#endif
    for (int64_t d = 0; d < DV; d += 8) {
        __m256 a[NG];
        for (int h = 0; h < NG; ++h) {
            a[h] = _mm256_load_ps(acc + h*DV + d);
        }
        for (int64_t j = 0; j < n; ++j) {
            if (!live[j]) {
                continue;
            }
            const __m256 vv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (v0 + j*vstride + d*sizeof(ggml_fp16_t))));
            for (int h = 0; h < NG; ++h) {
                a[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + h*pstride + j), vv, a[h]);
            }
        }
        for (int h = 0; h < NG; ++h) {
            _mm256_store_ps(acc + h*DV + d, a[h]);
        }
    }
}
#endif

namespace {

constexpr int64_t BLK    = 32;   // cells per block
constexpr int64_t MAX_D  = 256;  // head size
constexpr int64_t MAX_G  = 16;   // query heads per KV head

// What both entry points read from the op, checked once: the kernel's cases (F16 or a quantized cache with a
// to_float, F32 queries, no sinks, ALiBi or softcap, heads up to 256, one stream, one mask for every head).
struct page_fa_op {
    const ggml_tensor * q, * k, * v, * mask;
    float scale;
    int64_t DK, DV, G, n_kv_heads;
    bool f16;
    ggml_to_float_t to_f32;
};

bool page_fa_read_op(const ggml_tensor * dst, page_fa_op & op) {
    op.q = dst->src[0];
    op.k = dst->src[1];
    op.v = dst->src[2];
    op.mask = dst->src[3];
    const ggml_tensor * sinks = dst->src[4];
    float max_bias = 0.0f, logit_softcap = 0.0f;
    memcpy(&op.scale,      (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias,      (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&logit_softcap, (const float *) dst->op_params + 2, sizeof(float));
    const ggml_tensor * q = op.q, * k = op.k, * v = op.v, * mask = op.mask;
    op.DK = k->ne[0];
    op.DV = v->ne[0];
    const int64_t n_q_heads = q->ne[2];
    op.n_kv_heads = k->ne[2];
    op.f16 = k->type == GGML_TYPE_F16;
    op.to_f32 = op.f16 ? nullptr : ggml_get_type_traits(k->type)->to_float;
    if (k->type != v->type || k->type == GGML_TYPE_F32 || (!op.f16 && !op.to_f32) || q->type != GGML_TYPE_F32 ||
        sinks || max_bias != 0.0f || logit_softcap != 0.0f || op.DK > MAX_D || op.DV > MAX_D ||
        q->ne[3] != 1 || k->ne[3] != 1 || v->ne[3] != 1 || v->ne[2] != op.n_kv_heads ||
        op.n_kv_heads == 0 || n_q_heads % op.n_kv_heads != 0 || n_q_heads / op.n_kv_heads > MAX_G ||
        (mask && (mask->ne[2] != 1 || mask->ne[3] != 1 || mask->ne[1] < q->ne[1]))) {
        return false;
    }
    op.G = n_q_heads / op.n_kv_heads;
    return true;
}

// Query row iq1's G heads that share KV head ik2, over cells [ic_start, ic_end): the online softmax's running
// maximum M[g], sum S[g] and unnormalised output acc[g*DV ..]. Masked cells' values are never used.
void page_fa_row(const page_fa_op & op, int64_t iq1, int64_t ik2, int64_t ic_start, int64_t ic_end,
                 float * acc, float * M, float * S) {
    const ggml_tensor * q = op.q, * k = op.k, * v = op.v, * mask = op.mask;
    const int64_t DK = op.DK, DV = op.DV, G = op.G;
    const bool f16 = op.f16;
    const ggml_to_float_t to_f32 = op.to_f32;
    const float scale = op.scale;

    alignas(64) float Qf [MAX_G*MAX_D];
    alignas(64) float Kf [MAX_D];
    alignas(64) float Vf [MAX_D];
    alignas(64) float s  [MAX_G*BLK];
    alignas(64) float p  [MAX_G*BLK];
    bool  live[BLK];

    const ggml_fp16_t * mp = mask ? (const ggml_fp16_t *) ((const char *) mask->data + iq1*mask->nb[1]) : nullptr;

    {
        for (int64_t g = 0; g < G; ++g) {
            const float * pq = (const float *) ((const char *) q->data + iq1*q->nb[1] + (ik2*G + g)*q->nb[2]);
            for (int64_t d = 0; d < DK; ++d) {
                Qf[g*DK + d] = pq[d]*scale;
            }
            memset(acc + g*DV, 0, DV*sizeof(float));
            M[g] = -INFINITY;
            S[g] = 0.0f;
        }
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
        if (f16 && DK % 8 == 0 && DV % 8 == 0) {
            // K and V are read from the cache and converted in registers: four cells' scores for up to three
            // heads per pass (one horizontal reduction for the four), V accumulated 8 lanes at a time for up to
            // four heads per pass; masked cells are never read (their memory may hold anything)
            const char * kbase = (const char *) k->data + ik2*k->nb[2];
            const char * vbase = (const char *) v->data + ik2*v->nb[2];
            for (int64_t ib = ic_start; ib < ic_end; ib += BLK) {
                const int64_t n = std::min(BLK, ic_end - ib);
                alignas(32) float mvs[BLK];
                bool any = false;
                for (int64_t i = 0; i < n; ++i) {
                    mvs[i]  = mp ? GGML_CPU_FP16_TO_FP32(mp[ib + i]) : 0.0f;
                    live[i] = mvs[i] != -INFINITY;
                    any = any || live[i];
                }
                if (!any) {
                    continue;
                }
                const char * kb = kbase + ib*k->nb[1];
                const char * vb = vbase + ib*v->nb[1];
                for (int64_t g0 = 0; g0 < G; g0 += 3) {
                    const int64_t ng = std::min<int64_t>(3, G - g0);
                    int64_t i = 0;
                    for (; i + 4 <= n; i += 4) {
                        if (!(live[i] | live[i + 1] | live[i + 2] | live[i + 3])) {
                            continue;
                        }
                        switch (ng) {
                            case 1:  page_fa_kq4<1>(Qf + g0*DK, DK, kb + i*k->nb[1], k->nb[1], mvs + i, s + g0*BLK + i, BLK); break;
                            case 2:  page_fa_kq4<2>(Qf + g0*DK, DK, kb + i*k->nb[1], k->nb[1], mvs + i, s + g0*BLK + i, BLK); break;
                            default: page_fa_kq4<3>(Qf + g0*DK, DK, kb + i*k->nb[1], k->nb[1], mvs + i, s + g0*BLK + i, BLK); break;
                        }
                    }
                    for (; i < n; ++i) {
                        if (!live[i]) {
                            continue;
                        }
                        ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) (kb + i*k->nb[1]), Kf, DK);
                        for (int64_t g = g0; g < g0 + ng; ++g) {
                            float sv;
                            ggml_vec_dot_f32((int) DK, &sv, 0, Qf + g*DK, 0, Kf, 0, 1);
                            s[g*BLK + i] = sv + mvs[i];
                        }
                    }
                }
                for (int64_t g = 0; g < G; ++g) {
                    float * sg = s + g*BLK;
                    for (int64_t i = 0; i < n; ++i) {
                        if (!live[i]) {
                            sg[i] = -INFINITY;
                        }
                    }
                    float mx = -INFINITY;
                    ggml_vec_max_f32((int) n, &mx, sg);
                    if (mx > M[g]) {
                        const float ms = M[g] == -INFINITY ? 0.0f : expf(M[g] - mx);
                        ggml_vec_scale_f32((int) DV, acc + g*DV, ms);
                        S[g] *= ms;
                        M[g] = mx;
                    }
                    S[g] += (float) ggml_vec_soft_max_f32((int) n, p + g*BLK, sg, M[g]);
                }
                for (int64_t g0 = 0; g0 < G; g0 += 4) {
                    switch (std::min<int64_t>(4, G - g0)) {
                        case 1:  page_fa_pv<1>(acc + g0*DV, DV, p + g0*BLK, BLK, vb, v->nb[1], live, n); break;
                        case 2:  page_fa_pv<2>(acc + g0*DV, DV, p + g0*BLK, BLK, vb, v->nb[1], live, n); break;
                        case 3:  page_fa_pv<3>(acc + g0*DV, DV, p + g0*BLK, BLK, vb, v->nb[1], live, n); break;
                        default: page_fa_pv<4>(acc + g0*DV, DV, p + g0*BLK, BLK, vb, v->nb[1], live, n); break;
                    }
                }
            }
        } else
#endif
        for (int64_t ib = ic_start; ib < ic_end; ib += BLK) {
            const int64_t n = std::min(BLK, ic_end - ib);
            bool any = false;
            for (int64_t i = 0; i < n; ++i) {
                const float mv = mp ? GGML_CPU_FP16_TO_FP32(mp[ib + i]) : 0.0f;
                live[i] = mv != -INFINITY;
                if (!live[i]) {
                    for (int64_t g = 0; g < G; ++g) {
                        s[g*BLK + i] = -INFINITY;
                    }
                    continue;
                }
                any = true;
                const char * krow = (const char *) k->data + (ib + i)*k->nb[1] + ik2*k->nb[2];
                if (f16) {
                    ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) krow, Kf, DK);
                } else {
                    to_f32(krow, Kf, DK);
                }
                for (int64_t g = 0; g < G; ++g) {
                    float sv;
                    ggml_vec_dot_f32((int) DK, &sv, 0, Qf + g*DK, 0, Kf, 0, 1);
                    s[g*BLK + i] = sv + mv;
                }
            }
            if (!any) {
                continue;
            }
            for (int64_t g = 0; g < G; ++g) {
                float mx = -INFINITY;
                ggml_vec_max_f32((int) n, &mx, s + g*BLK);
                if (mx > M[g]) {
                    const float ms = M[g] == -INFINITY ? 0.0f : expf(M[g] - mx);
                    ggml_vec_scale_f32((int) DV, acc + g*DV, ms);
                    S[g] *= ms;
                    M[g] = mx;
                }
                S[g] += (float) ggml_vec_soft_max_f32((int) n, p + g*BLK, s + g*BLK, M[g]);
            }
            for (int64_t i = 0; i < n; ++i) {
                if (!live[i]) {
                    continue;
                }
                const char * vrow = (const char *) v->data + (ib + i)*v->nb[1] + ik2*v->nb[2];
                if (f16) {
                    ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) vrow, Vf, DV);
                } else {
                    to_f32(vrow, Vf, DV);
                }
                for (int64_t g = 0; g < G; ++g) {
                    ggml_vec_mad_f32((int) DV, acc + g*DV, Vf, p[g*BLK + i]);
                }
            }
        }
    }
}

}  // namespace

bool page_fa_decode_chunk(const ggml_tensor * dst, int64_t ic_start, int64_t ic_end,
                          float * partials, int64_t partial_stride) {
    page_fa_op op;
    if (!page_fa_read_op(dst, op) || op.q->ne[1] != 1) {
        return false;
    }
    alignas(64) float acc[MAX_G*MAX_D];
    float M[MAX_G], S[MAX_G];
    for (int64_t ik2 = 0; ik2 < op.n_kv_heads; ++ik2) {
        page_fa_row(op, 0, ik2, ic_start, ic_end, acc, M, S);
        for (int64_t g = 0; g < op.G; ++g) {
            float * partial = partials + (ik2*op.G + g)*partial_stride;
            partial[0] = M[g];
            partial[1] = S[g];
            memcpy(partial + 2, acc + g*op.DV, op.DV*sizeof(float));
        }
    }
    return true;
}

bool page_fa_rows(const ggml_tensor * dst, int ith, int nth) {
    page_fa_op op;
    if (!page_fa_read_op(dst, op)) {
        return false;
    }
    // (KV head, query row) pairs, KV head first: a thread's consecutive rows read the same K and V
    const int64_t N = op.q->ne[1];
    const int64_t n_items = N*op.n_kv_heads;
    const int64_t it0 = n_items*ith/nth, it1 = n_items*(ith + 1)/nth;
    const int64_t nkv = op.k->ne[1];
    alignas(64) float acc[MAX_G*MAX_D];
    float M[MAX_G], S[MAX_G];
    for (int64_t it = it0; it < it1; ++it) {
        const int64_t ik2 = it / N, iq1 = it % N;
        page_fa_row(op, iq1, ik2, 0, nkv, acc, M, S);
        for (int64_t g = 0; g < op.G; ++g) {
            // normalised as the split-KV path's reduction does (one chunk: the same bits as a one-token step)
            float * o = acc + g*op.DV;
            if (S[g] != 0.0f) {
                ggml_vec_scale_f32((int) op.DV, o, 1.0f/S[g]);
            }
            memcpy((char *) dst->data + ((ik2*op.G + g) + iq1*dst->ne[1])*dst->nb[1], o, op.DV*sizeof(float));
        }
    }
    return true;
}

// page-lorekv.cpp — LORE-KV's deletion costs (see llama-page.h for the contract; the math: docs/algorithms.md
// §4.2–4.3).
//
// Armed with llama_page_probe_arm_cost, the probe's hooks (page-probe.cpp) build the same softmax as the
// attention probe and hand it here: per layer, the head outputs o = A V and the projected distances
// ||R_h (v_p - o)|| through the expansion ||R v||^2 + ||R o||^2 - 2 (R v).(R o) (one matmul over the keys,
// like attention itself), weighted by a / (1 - a):
//     F32 [n_kv, n_query]  per layer, summed over the query heads.
// The factors R_h come from llama_page_set_out_proj (page-outproj.cpp). Only ops that the CPU, CUDA and Metal
// backends all implement are used (mul_mat, scale/add, permute + cont, sum_rows, cpy, sqr/sqrt/relu/clamp,
// mul/div).

#include "llama-page.h"
#include "page-probe.h"
#include "page-state.h"

#include "llama-context.h"
#include "llama-hparams.h"
#include "llama-model.h"
#include "llama-kv-cache.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// a fingerprint of the (position, cell) pairs of seq_id in every cache of the context
uint64_t cells_key(const llama_context * ctx, llama_seq_id seq_id) {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](uint64_t x) { h = (h ^ x) * 1099511628211ull; };
    const llama_kv_cache * base = page_layer_cache(ctx, -1);
    const int n_layer = (int) ctx->get_model().hparams.n_layer();
    const llama_kv_cache * swa = nullptr;
    for (int il = 0; il < n_layer && !swa; ++il) {
        const llama_kv_cache * kv = page_layer_cache(ctx, il);
        swa = kv != base ? kv : nullptr;
    }
    for (const llama_kv_cache * kv : { base, swa }) {
        if (!kv) {
            continue;
        }
        for (const auto & [pos, cell] : kv->get_cells(seq_id).seq_pos_get(seq_id)) {
            mix((uint64_t) (uint32_t) pos);
            mix((uint64_t) cell);
        }
        mix(0xffffffffull);
    }
    return h;
}

} // namespace

// Cost mode: per layer F32 [n_kv, n_query] on the device -> [n_layer, n_query, n_pos] over the
// positions of the target sequence (cells mapped through each layer's own cache).
std::string page_lorekv_collect(llama_context * ctx, page_probe_state & st) {
    const int32_t n_layer = (int32_t) st.layers.size();
    const int32_t n_query = (int32_t) st.queries.size();

    std::vector<llama_pos> all;
    const llama_kv_cache * base = page_layer_cache(ctx, -1);
    for (const auto & pc : base->get_cells(st.seq_id).seq_pos_get(st.seq_id)) {
        all.push_back(pc.first);
    }
    std::sort(all.begin(), all.end());
    const int64_t n_pos = (int64_t) all.size();
    if (n_pos == 0) {
        return "the target sequence holds no positions";
    }

    st.costs.assign((size_t) n_layer * n_query * n_pos, 0.0f);
    std::vector<float> buf;
    for (int32_t il = 0; il < n_layer; ++il) {
        const page_layer_capture & lc = st.layers[il];
        buf.resize((size_t) lc.n_kv * n_query);
        ggml_backend_tensor_get(lc.sum, buf.data(), 0, buf.size() * sizeof(float));
        const llama_kv_cache * kv = page_layer_cache(ctx, il);
        for (const auto & [pos, cell] : kv->get_cells(st.seq_id).seq_pos_get(st.seq_id)) {
            if ((int64_t) cell >= lc.n_kv) {
                continue;
            }
            const int64_t ip = std::lower_bound(all.begin(), all.end(), pos) - all.begin();
            for (int32_t iq = 0; iq < n_query; ++iq) {
                st.costs[((size_t) il * n_query + iq) * n_pos + ip] = buf[(size_t) iq * lc.n_kv + cell];
            }
        }
    }
    st.n_layer   = n_layer;
    st.n_head    = (int32_t) ctx->get_model().hparams.n_head(0);
    st.positions = std::move(all);
    st.mean.clear();
    st.topk_pos.clear();
    st.topk_score.clear();
    st.rows.clear();
    st.has_costs = true;
    // every cost decode leaves the value norms of all its cells in the cache (computed or reused)
    st.vn_valid = true;
    st.vn_key   = cells_key(ctx, st.seq_id);
    return "";
}

// Deletion cost of every key for every query, summed over heads: F32 [n_kv, n_query]. a = kq
// [n_kv, n_q, n_head] (the softmax), v as given to build_attn_mha (after its permute). With
// G_h = R_h^T R_h:  ||R_h (v_p - o)||^2 = ||R_h v_p||^2 - 2 v_p . (G_h o) + o . (G_h o).
ggml_tensor * page_lorekv_build(ggml_context * ctx0, ggml_cgraph * gf, page_probe_state & st,
                                ggml_tensor * a, ggml_tensor * v, bool v_trans, int il) {
    page_out_proj * proj = st.proj.get();
    ggml_tensor * r = proj && il < (int) proj->r.size() ? proj->r[il] : nullptr;
    const int64_t d_v    = v_trans ? v->ne[1] : v->ne[0];
    const int64_t n_kv   = a->ne[0];
    const int64_t n_q    = a->ne[1];
    const int64_t n_head = a->ne[2];
    if (!r || r->ne[0] != d_v || r->ne[2] != n_head) {
        st.batch_error = "the deletion-cost probe has no output-projection factors matching layer " + std::to_string(il) +
                         " (call llama_page_set_out_proj first)";
        return nullptr;
    }
    if (n_kv > proj->n_cells) {
        st.batch_error = "internal: the deletion-cost probe's value-norm cache is smaller than the KV cache";
        return nullptr;
    }
    // values in F32, [d_v, n_kv, n_head_kv] and [n_kv, d_v, n_head_kv] (the cache may hold F16)
    ggml_tensor * vd = ggml_cast(ctx0, v_trans ? ggml_transpose(ctx0, v) : v, GGML_TYPE_F32);
    ggml_tensor * vt = ggml_cont(ctx0, ggml_transpose(ctx0, vd));
    ggml_tensor * g  = proj->g[il];                                                       // [d_v, d_v, H] G_h
    ggml_tensor * o  = ggml_mul_mat(ctx0, vt, a);                                         // [d_v, n_q, H] head outputs
    ggml_tensor * go = ggml_mul_mat(ctx0, g, o);                                          // [d_v, n_q, H] G_h o
    ggml_tensor * on = ggml_sum_rows(ctx0, ggml_mul(ctx0, o, go));                        // [1, n_q, H]
    ggml_tensor * d2 = ggml_scale(ctx0, ggml_mul_mat(ctx0, vd, go), -2.0f);               // [n_kv, n_q, H] (GQA broadcast)

    ggml_tensor * vn_cache = ggml_view_3d(ctx0, proj->vn[il], n_kv, 1, n_head,
                                          proj->vn[il]->nb[1], proj->vn[il]->nb[1], 0); // [n_kv, 1, H]
    ggml_tensor * vn;
    if (st.vn_reuse) {
        vn = vn_cache;
    } else {
        // R_h v_p for every cell, as one weight-by-activation product per KV head: the factors of the
        // n_rep query heads that share a KV head are stacked into one [d_v, d_v * n_rep] weight, and
        // the squares are summed along the contiguous axis (no transposed copy of [d_v, n_kv, H])
        const int64_t n_head_kv = vd->ne[2];
        const int64_t n_rep     = n_head / n_head_kv;
        ggml_tensor * rg = ggml_reshape_3d(ctx0, r, d_v, d_v * n_rep, n_head_kv);           // [d_v, d_v*n_rep, H_kv]
        ggml_tensor * rv = ggml_reshape_4d(ctx0, ggml_mul_mat(ctx0, rg, vd), d_v, n_rep, n_kv, n_head_kv);
        ggml_tensor * sq = ggml_sum_rows(ctx0, ggml_sqr(ctx0, rv));                           // [1, n_rep, n_kv, H_kv]
        vn = ggml_reshape_3d(ctx0, ggml_cont(ctx0, ggml_permute(ctx0, sq, 1, 2, 0, 3)), n_kv, 1, n_head); // [n_kv, 1, H]
        ggml_build_forward_expand(gf, ggml_cpy(ctx0, vn, vn_cache));
    }
    d2 = ggml_add(ctx0, ggml_add(ctx0, d2, vn), on);
    ggml_tensor * dist = ggml_sqrt(ctx0, ggml_relu(ctx0, d2));
    ggml_tensor * w = ggml_div(ctx0, a, ggml_clamp(ctx0, ggml_scale_bias(ctx0, a, -1.0f, 1.0f), 1e-6f, 1.0f));
    ggml_tensor * c = ggml_mul(ctx0, w, dist);                                            // [n_kv, n_q, H]
    c = ggml_sum_rows(ctx0, ggml_cont(ctx0, ggml_permute(ctx0, c, 1, 2, 0, 3)));          // [1, n_kv, n_q]
    return ggml_reshape_2d(ctx0, c, n_kv, n_q);
}

//
// public API
//

int32_t llama_page_probe_arm_cost(llama_context * ctx, llama_seq_id target_seq, bool reuse_value_norms) {
    page_set_error("");
    if (int32_t rc = page_check_seq(ctx, target_seq); rc != LLAMA_PAGE_OK) {
        return rc;
    }
    try {
        page_probe_state & st = page_probe_get(ctx);
        if (!st.proj) {
            page_set_error("the deletion-cost probe needs the output-projection factors: call llama_page_set_out_proj first");
            return LLAMA_PAGE_ERR_INVALID_ARG;
        }
        // reuse only what is known to be the norms of exactly these cells
        st.vn_reuse   = reuse_value_norms && st.vn_valid && st.vn_key == cells_key(ctx, target_seq);
        st.armed      = true;
        st.cost_mode  = true;
        st.seq_id     = target_seq;
        st.top_k      = 1;
        st.keep_rows  = false;
        st.n_last     = 0;
        st.has_result = false;
        st.failure.clear();
    } catch (const std::exception & e) {
        page_set_error(std::string("internal: ") + e.what());
        return LLAMA_PAGE_ERR_INTERNAL;
    }
    return LLAMA_PAGE_OK;
}

int32_t llama_page_probe_get_costs(const llama_context * ctx, float * costs, int64_t n) {
    page_set_error("");
    const page_probe_state * st = page_probe_result(ctx);
    if (!st) {
        return LLAMA_PAGE_ERR_NO_RESULT;
    }
    if (!st->has_costs) {
        page_set_error("no deletion costs: the last probe was an attention probe (arm it with llama_page_probe_arm_cost)");
        return LLAMA_PAGE_ERR_NO_RESULT;
    }
    return page_copy_out(st->costs, costs, n, "costs");
}

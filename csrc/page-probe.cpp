// page-probe.cpp — the attention probe (see llama-page.h for the contract).
//
// Arming a probe makes the next llama_decode() build its graph with, per attention layer, one
// side branch: softmax(q k^T * scale + mask) for the batch's queries (the same ops the non-flash
// attention path uses, so it holds for flash attention on or off), summed over the queries:
//     F32 [n_kv, n_head]   per layer, marked as a graph output.
// After the decode those sums are copied to the host, cells are mapped to positions through the
// layer's own KV cache (the SWA cache for sliding-window layers), and the top-k per head is taken.
// The deletion-cost mode (llama_page_probe_arm_cost) reuses the same softmax and adds, per layer,
// the head outputs o = A V and the projected distances ||R_h (v_p - o)|| through the expansion
// ||R v||^2 + ||R o||^2 - 2 (R v).(R o) (one matmul over the keys, like attention itself):
//     F32 [n_kv, n_query]  per layer, summed over the query heads.
// Only ops that the CPU, CUDA and Metal backends all implement are used
// (mul_mat, tanh/scale/add, soft_max_ext, permute + cont, sum_rows, cpy, sqr/sqrt/relu/clamp, mul/div).

#include "llama-page.h"
#include "page-hooks.h"
#include "page-state.h"

#include "llama-context.h"
#include "llama-hparams.h"
#include "llama-model.h"
#include "llama-batch.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct layer_capture {
    ggml_tensor * sum  = nullptr; // F32 [n_kv, n_head]: softmax summed over the batch's queries
                                  // (cost mode: F32 [n_kv, n_query], deletion cost summed over heads)
    int64_t       n_kv = 0;
    // a layer on a remote (RPC) device, rows not kept: what is read back instead of `sum`, reduced
    // on the device so that little crosses the wire
    ggml_tensor * top_idx  = nullptr; // I32 [k, n_head]: each head's k largest cells, in no order
    ggml_tensor * top_val  = nullptr; // F32 [1, k, n_head]: their sums
    ggml_tensor * head_sum = nullptr; // F32 [1, n_kv]: the sums added over the heads
};

// whether a tensor (or the tensor it views) lives in a buffer of ggml's RPC backend
bool on_rpc_device(const ggml_tensor * t) {
    while (t && t->view_src) {
        t = t->view_src;
    }
    if (!t || !t->buffer) {
        return false;
    }
    return std::strncmp(ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer)), "RPC", 3) == 0;
}

// R_h factors of the output projection, one F32 [d_v, d_v, n_head] tensor per layer (row-major R_h),
// on the device that holds the layer's W_O; beside them, per layer, F32 [n_ctx, n_head]: ||R_h v||^2
// of every cell's value, cached by the first cost decode of a lookahead (the prompt's values do not
// change while futures are decoded, and this d_v^2-per-cell product is the probe's dominant cost)
struct out_proj {
    std::vector<ggml_context *>         ctxs;
    std::vector<ggml_backend_buffer_t>  bufs;
    std::vector<ggml_tensor *>          r;
    std::vector<ggml_tensor *>          g;  // F32 [d_v, d_v, n_head] per layer: G_h = R_h^T R_h (symmetric)
    std::vector<ggml_tensor *>          vn;
    int64_t                             d_v = 0;
    int64_t                             n_cells = 0; // rows of vn

    out_proj() = default;
    out_proj(const out_proj &) = delete;
    out_proj & operator=(const out_proj &) = delete;
    ~out_proj() {
        for (ggml_backend_buffer_t b : bufs) {
            ggml_backend_buffer_free(b);
        }
        for (ggml_context * c : ctxs) {
            ggml_free(c);
        }
    }
};

struct probe_state {
    // arming
    bool         armed     = false;
    llama_seq_id seq_id    = -1;
    int32_t      top_k     = 32;
    bool         keep_rows = false;
    int32_t      n_last    = 0;     // the probe reads the batch's last n_last queries only (0: all of them)
    int32_t      q_skip    = 0;     // the armed ubatch's leading tokens the probe skips (n_tokens - n_last)
    bool         cost_mode = false; // armed with llama_page_probe_arm_cost (seq_id is the target sequence)
    bool         vn_reuse  = false; // the armed cost decode reads the cached value norms
    bool         vn_valid  = false; // the cache holds the norms of the cells named by vn_key
    uint64_t     vn_key    = 0;
    std::unique_ptr<out_proj> proj;

    // the armed decode
    int                        n_ubatch    = 0;
    std::string                batch_error;
    std::vector<llama_pos>     queries;
    std::vector<layer_capture> layers;
    bool                       graph_has_probe = false;
    ggml_cgraph *              build_gf = nullptr; // the graph being built (cost mode adds cache writes)

    // the result
    bool                   has_result = false;
    std::string            failure;   // why there is no result
    int32_t                n_layer = 0;
    int32_t                n_head  = 0;
    std::vector<llama_pos> positions;  // [n_pos]
    std::vector<float>     mean;       // [n_layer, n_pos]
    std::vector<llama_pos> topk_pos;   // [n_layer, n_head, top_k]
    std::vector<float>     topk_score; // [n_layer, n_head, top_k]
    std::vector<float>     rows;       // [n_layer, n_head, n_pos] if keep_rows
    bool                   has_costs = false;
    std::vector<float>     costs;      // [n_layer, n_query, n_pos] in cost mode
};

std::mutex                                               g_mutex;
std::unordered_map<const llama_context *, probe_state>  g_states;
std::atomic<int>                                         g_n_states{0};

// the state whose probe graph is being built on this thread (set between ubatch_begin and decode_end)
thread_local probe_state * tl_build = nullptr;

probe_state * find_state(const llama_context * ctx) {
    if (g_n_states.load(std::memory_order_relaxed) == 0) {
        return nullptr;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_states.find(ctx);
    return it == g_states.end() ? nullptr : &it->second;
}

probe_state & get_state(const llama_context * ctx) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_states.find(ctx);
    if (it == g_states.end()) {
        it = g_states.emplace(ctx, probe_state{}).first;
        g_n_states.fetch_add(1);
    }
    return it->second;
}

const probe_state * result_of(const llama_context * ctx) {
    if (!ctx) {
        return nullptr;
    }
    const probe_state * st = find_state(ctx);
    if (!st) {
        page_set_error("no probe result: the probe was never armed on this context");
        return nullptr;
    }
    if (!st->has_result) {
        page_set_error(st->armed ? "no probe result yet: the probe is armed but llama_decode() has not run"
                                 : (st->failure.empty() ? "no probe result" : st->failure));
        return nullptr;
    }
    return st;
}

const probe_state * attention_result_of(const llama_context * ctx) {
    const probe_state * st = result_of(ctx);
    if (st && st->has_costs) {
        page_set_error("the last probe computed deletion costs; attention scores need llama_page_probe_arm");
        return nullptr;
    }
    return st;
}

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

// Cost mode: per layer F32 [n_kv, n_query] on the device -> [n_layer, n_query, n_pos] over the
// positions of the target sequence (cells mapped through each layer's own cache).
std::string collect_costs(llama_context * ctx, probe_state & st) {
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
        const layer_capture & lc = st.layers[il];
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

// the buffer type for layer il's R factors: where its W_O lives (host memory: the plain CPU type,
// never an extra type such as a repacking one)
ggml_backend_buffer_type_t proj_buft(const llama_model & model, int il) {
    const ggml_tensor * wo = il < (int) model.layers.size() ? model.layers[il].wo : nullptr;
    if (!wo || !wo->buffer) {
        return ggml_backend_cpu_buffer_type();
    }
    ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(wo->buffer);
    if (ggml_backend_buft_is_host(buft)) {
        return ggml_backend_cpu_buffer_type();
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    return dev ? ggml_backend_dev_buffer_type(dev) : ggml_backend_cpu_buffer_type();
}

// A layer reduced on its device: the head sums give the mean, the device's per-head top-k (over every
// cell, in no order) is filtered to the cells this layer's queries see and sorted as the host path
// sorts (descending score, then ascending position). Scores are those of the host path; only which of
// several exactly equal scores make the cut can differ.
void collect_reduced(probe_state & st, int32_t il, const std::vector<std::pair<llama_pos, uint32_t>> & visible,
                     const std::vector<llama_pos> & all, int32_t n_head, int32_t n_query) {
    const layer_capture & lc = st.layers[il];
    const int64_t n_pos = (int64_t) all.size();
    const int32_t k  = st.top_k;
    const int64_t kd = lc.top_idx->ne[0];
    std::vector<int32_t> ids((size_t) kd * n_head);
    std::vector<float>   vals((size_t) kd * n_head);
    std::vector<float>   hsum((size_t) lc.n_kv);
    ggml_backend_tensor_get(lc.top_idx,  ids.data(),  0, ids.size()  * sizeof(int32_t));
    ggml_backend_tensor_get(lc.top_val,  vals.data(), 0, vals.size() * sizeof(float));
    ggml_backend_tensor_get(lc.head_sum, hsum.data(), 0, hsum.size() * sizeof(float));
    std::vector<int64_t> col((size_t) lc.n_kv, -1); // cell -> column of `all`, -1 when not visible
    for (const auto & [pos, cell] : visible) {
        const int64_t ip = std::lower_bound(all.begin(), all.end(), pos) - all.begin();
        col[cell] = ip;
        st.mean[(size_t) il * n_pos + ip] = hsum[cell] / (float) n_query / (float) n_head;
    }
    std::vector<std::pair<float, int64_t>> cand;
    for (int32_t h = 0; h < n_head; ++h) {
        cand.clear();
        for (int64_t j = 0; j < kd; ++j) {
            const int32_t c = ids[(size_t) h * kd + j];
            if (c >= 0 && c < lc.n_kv && col[c] >= 0) {
                cand.emplace_back(vals[(size_t) h * kd + j] / (float) n_query, col[c]);
            }
        }
        std::sort(cand.begin(), cand.end(), [](const auto & a, const auto & b) {
            return a.first > b.first || (a.first == b.first && a.second < b.second);
        });
        const size_t kk = std::min<size_t>((size_t) k, cand.size());
        for (size_t j = 0; j < kk; ++j) {
            st.topk_pos  [((size_t) il * n_head + h) * k + j] = all[cand[j].second];
            st.topk_score[((size_t) il * n_head + h) * k + j] = cand[j].first;
        }
    }
}

// Copy the device sums to the host and turn them into the per-position result.
std::string collect(llama_context * ctx, probe_state & st) {
    const llama_model   & model   = ctx->get_model();
    const llama_hparams & hparams = model.hparams;

    const int32_t n_layer = (int32_t) hparams.n_layer();
    const int32_t n_head  = (int32_t) hparams.n_head(0);
    const int32_t n_query = (int32_t) st.queries.size();

    if ((int32_t) st.layers.size() < n_layer) {
        return "internal: probe captured fewer layers than the model has";
    }
    for (int32_t il = 0; il < n_layer; ++il) {
        if (!st.layers[il].sum) {
            return "layer " + std::to_string(il) + " has no attention over the KV cache; the probe supports transformer layers only";
        }
        if (!st.cost_mode && (int32_t) st.layers[il].sum->ne[1] != n_head) {
            return "layers with different head counts are not supported by the probe";
        }
    }

    ctx->synchronize();

    if (st.cost_mode) {
        return collect_costs(ctx, st);
    }

    // per layer: (position, cell) pairs that the batch's queries can see
    const llama_pos q_max = *std::max_element(st.queries.begin(), st.queries.end());
    std::vector<std::vector<std::pair<llama_pos, uint32_t>>> visible(n_layer);
    std::vector<llama_pos> all;
    for (int32_t il = 0; il < n_layer; ++il) {
        const llama_kv_cache * kv = page_layer_cache(ctx, il);
        if (!kv) {
            return "the context's memory is not a KV cache";
        }
        const bool swa = hparams.is_swa(il);
        const auto & cells = kv->get_cells(st.seq_id);
        for (const auto & [pos, cell] : cells.seq_pos_get(st.seq_id)) {
            if (pos > q_max || (int64_t) cell >= st.layers[il].n_kv) {
                continue;
            }
            bool seen = !swa;
            for (llama_pos q : st.queries) {
                if (seen) {
                    break;
                }
                seen = pos <= q && !llama_hparams::is_masked_swa(hparams.n_swa, hparams.swa_type, pos, q);
            }
            if (seen) {
                visible[il].emplace_back(pos, cell);
                all.push_back(pos);
            }
        }
    }
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
    const int64_t n_pos = (int64_t) all.size();
    if (n_pos == 0) {
        return "the armed sequence has no visible positions";
    }

    const int32_t k = st.top_k;
    std::vector<float> rows((size_t) n_layer * n_head * n_pos, 0.0f);
    std::vector<float> sums;
    for (int32_t il = 0; il < n_layer; ++il) {
        const layer_capture & lc = st.layers[il];
        if (lc.top_idx) {
            continue; // reduced on its device: read below
        }
        sums.resize((size_t) lc.n_kv * n_head);
        ggml_backend_tensor_get(lc.sum, sums.data(), 0, sums.size() * sizeof(float));
        for (const auto & [pos, cell] : visible[il]) {
            const int64_t ip = std::lower_bound(all.begin(), all.end(), pos) - all.begin();
            for (int32_t h = 0; h < n_head; ++h) {
                rows[((size_t) il * n_head + h) * n_pos + ip] = sums[(size_t) h * lc.n_kv + cell] / (float) n_query;
            }
        }
    }

    st.mean.assign((size_t) n_layer * n_pos, 0.0f);
    st.topk_pos.assign((size_t) n_layer * n_head * k, -1);
    st.topk_score.assign((size_t) n_layer * n_head * k, 0.0f);
    std::vector<int64_t> idx;
    for (int32_t il = 0; il < n_layer; ++il) {
        if (st.layers[il].top_idx) {
            collect_reduced(st, il, visible[il], all, n_head, n_query);
            continue;
        }
        // candidate columns: the positions visible in this layer
        idx.clear();
        for (const auto & pc : visible[il]) {
            idx.push_back(std::lower_bound(all.begin(), all.end(), pc.first) - all.begin());
        }
        std::sort(idx.begin(), idx.end());
        const int64_t kk = std::min<int64_t>(k, (int64_t) idx.size());
        for (int32_t h = 0; h < n_head; ++h) {
            const float * row = &rows[((size_t) il * n_head + h) * n_pos];
            for (int64_t ip = 0; ip < n_pos; ++ip) {
                st.mean[(size_t) il * n_pos + ip] += row[ip] / (float) n_head;
            }
            // ties: lower position first (idx is ascending in position)
            std::partial_sort(idx.begin(), idx.begin() + kk, idx.end(), [row](int64_t a, int64_t b) {
                return row[a] > row[b] || (row[a] == row[b] && a < b);
            });
            for (int64_t j = 0; j < kk; ++j) {
                st.topk_pos  [((size_t) il * n_head + h) * k + j] = all[idx[j]];
                st.topk_score[((size_t) il * n_head + h) * k + j] = row[idx[j]];
            }
            std::sort(idx.begin(), idx.end());
        }
    }

    st.n_layer   = n_layer;
    st.n_head    = n_head;
    st.positions = std::move(all);
    st.has_costs = false;
    st.costs.clear();
    if (st.keep_rows) {
        st.rows = std::move(rows);
    } else {
        st.rows.clear();
    }
    return "";
}

// Deletion cost of every key for every query, summed over heads: F32 [n_kv, n_query]. a = kq
// [n_kv, n_q, n_head] (the softmax), v as given to build_attn_mha (after its permute). With
// G_h = R_h^T R_h:  ||R_h (v_p - o)||^2 = ||R_h v_p||^2 - 2 v_p . (G_h o) + o . (G_h o).
ggml_tensor * build_costs(ggml_context * ctx0, probe_state * st, ggml_tensor * a, ggml_tensor * v, bool v_trans, int il) {
    out_proj * proj = st->proj.get();
    ggml_tensor * r = proj && il < (int) proj->r.size() ? proj->r[il] : nullptr;
    const int64_t d_v    = v_trans ? v->ne[1] : v->ne[0];
    const int64_t n_kv   = a->ne[0];
    const int64_t n_q    = a->ne[1];
    const int64_t n_head = a->ne[2];
    if (!r || r->ne[0] != d_v || r->ne[2] != n_head) {
        st->batch_error = "the deletion-cost probe has no output-projection factors matching layer " + std::to_string(il) +
                          " (call llama_page_set_out_proj first)";
        return nullptr;
    }
    if (n_kv > proj->n_cells) {
        st->batch_error = "internal: the deletion-cost probe's value-norm cache is smaller than the KV cache";
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
    if (st->vn_reuse) {
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
        ggml_build_forward_expand(st->build_gf, ggml_cpy(ctx0, vn, vn_cache));
    }
    d2 = ggml_add(ctx0, ggml_add(ctx0, d2, vn), on);
    ggml_tensor * dist = ggml_sqrt(ctx0, ggml_relu(ctx0, d2));
    ggml_tensor * w = ggml_div(ctx0, a, ggml_clamp(ctx0, ggml_scale_bias(ctx0, a, -1.0f, 1.0f), 1e-6f, 1.0f));
    ggml_tensor * c = ggml_mul(ctx0, w, dist);                                            // [n_kv, n_q, H]
    c = ggml_sum_rows(ctx0, ggml_cont(ctx0, ggml_permute(ctx0, c, 1, 2, 0, 3)));          // [1, n_kv, n_q]
    return ggml_reshape_2d(ctx0, c, n_kv, n_q);
}

template <typename T>
int32_t copy_out(const std::vector<T> & src, T * dst, int64_t n, const char * what) {
    if (!dst || n != (int64_t) src.size()) {
        page_set_error(std::string(what) + ": destination holds " + std::to_string(n) +
                       " elements, the result has " + std::to_string(src.size()));
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    std::copy(src.begin(), src.end(), dst);
    return LLAMA_PAGE_OK;
}

} // namespace

//
// hooks called from upstream (csrc/patches/01-probe-hooks.patch)
//

void llama_page_decode_begin(llama_context * ctx) {
    probe_state * st = find_state(ctx);
    if (!st || !st->armed) {
        return;
    }
    st->n_ubatch = 0;
    st->batch_error.clear();
    st->queries.clear();
    st->layers.assign(ctx->get_model().hparams.n_layer(), layer_capture{});
}

bool llama_page_ubatch_begin(llama_context * ctx, const llama_ubatch & ubatch) {
    tl_build = nullptr;
    probe_state * st = find_state(ctx);
    if (!st) {
        return false;
    }
    const bool had_probe = st->graph_has_probe;
    st->graph_has_probe = false;
    if (!st->armed) {
        return had_probe;
    }
    if (++st->n_ubatch > 1) {
        st->batch_error = "the armed batch was split into several ubatches; give the probe at most n_ubatch (" +
                          std::to_string(ctx->n_ubatch()) + ") tokens";
        return had_probe;
    }
    st->q_skip = (st->n_last > 0 && (uint32_t) st->n_last < ubatch.n_tokens) ? (int32_t) ubatch.n_tokens - st->n_last : 0;
    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        if (st->cost_mode) {
            if (ubatch.n_seq_id[i] != 1) {
                st->batch_error = "the deletion-cost probe needs one sequence per token in the armed batch";
                return had_probe;
            }
        } else if (ubatch.n_seq_id[i] != 1 || ubatch.seq_id[i][0] != st->seq_id) {
            st->batch_error = "the armed batch holds tokens of other sequences; the probe needs a batch of sequence " +
                              std::to_string(st->seq_id) + " only";
            return had_probe;
        }
        if ((int32_t) i >= st->q_skip) {
            st->queries.push_back(ubatch.pos[i]);
        }
    }
    st->graph_has_probe = true;
    tl_build = st;
    return true;
}

void llama_page_probe_attn(ggml_context * ctx0, ggml_cgraph * gf,
        ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, bool v_trans,
        ggml_tensor * kq_b, ggml_tensor * kq_mask, ggml_tensor * sinks,
        float kq_scale, const llama_hparams & hparams, bool grok_softcap, int il) {
    probe_state * st = tl_build;
    if (!st || il < 0 || il >= (int) st->layers.size()) {
        return;
    }
    if (k->ne[3] != 1 || q->ne[3] != 1) {
        st->batch_error = "the probe needs a single KV stream for the armed batch";
        return;
    }
    if (st->q_skip > 0) {
        // only the batch's last n_last queries: views of their rows of q [d, n_tokens, n_head] and of the mask
        // [n_kv, n_tokens (padded)]; the batch's other tokens are decoded as usual, the probe skips them
        if (kq_b || kq_mask->ne[2] != 1 || kq_mask->ne[3] != 1) {
            st->batch_error = "the probe cannot read only the last queries of a batch with a KQ bias or a "
                              "per-head mask; arm it on a batch of those queries alone";
            return;
        }
        const int64_t n_q = q->ne[1] - st->q_skip;
        q = ggml_view_3d(ctx0, q, q->ne[0], n_q, q->ne[2], q->nb[1], q->nb[2], (size_t) st->q_skip * q->nb[1]);
        kq_mask = ggml_view_2d(ctx0, kq_mask, kq_mask->ne[0], n_q, kq_mask->nb[1],
                               (size_t) st->q_skip * kq_mask->nb[1]);
    }

    // the same logits, caps, bias, mask and softmax as the non-flash path of build_attn_mha
    ggml_tensor * kq = ggml_mul_mat(ctx0, k, q); // [n_kv, n_tokens, n_head]
    ggml_prec_set_acc(kq, GGML_PREC_F32);
    if (grok_softcap) {
        kq = ggml_tanh(ctx0, ggml_scale(ctx0, kq, hparams.f_attn_out_scale / hparams.f_attn_logit_softcapping));
        kq = ggml_scale(ctx0, kq, hparams.f_attn_logit_softcapping);
    }
    if (hparams.attn_soft_cap) {
        kq = ggml_scale(ctx0, kq, 1.0f / hparams.f_attn_logit_softcapping);
        kq = ggml_tanh (ctx0, kq);
        kq = ggml_scale(ctx0, kq, hparams.f_attn_logit_softcapping);
    }
    if (kq_b) {
        kq = ggml_add(ctx0, kq, kq_b);
    }
    kq = ggml_soft_max_ext(ctx0, kq, kq_mask, kq_scale, hparams.f_max_alibi_bias);
    ggml_soft_max_add_sinks(kq, sinks);

    if (st->cost_mode) {
        st->build_gf = gf;
        ggml_tensor * t = build_costs(ctx0, st, kq, v, v_trans, il);
        if (t) {
            ggml_format_name(t, "page_cost-%d", il);
            ggml_set_output(t);
            ggml_build_forward_expand(gf, t);
            st->layers[il] = { t, k->ne[1] };
        }
        return;
    }

    // sum over the queries: [n_kv, n_tokens, n_head] -> [n_tokens, n_kv, n_head] -> [1, n_kv, n_head]
    ggml_tensor * t = ggml_cont(ctx0, ggml_permute(ctx0, kq, 1, 0, 2, 3));
    t = ggml_sum_rows(ctx0, t);
    t = ggml_reshape_2d(ctx0, t, t->ne[1], t->ne[2]);
    ggml_format_name(t, "page_probe-%d", il);

    const int64_t n_kv = t->ne[0], n_head = t->ne[1];
    if (on_rpc_device(k) && !st->keep_rows && st->top_k <= n_kv) {
        // a remote layer: reduce on its device (ggml's own ops, which RPC sends), read back the
        // per-head top-k and the head sums: k * n_head * 8 + n_kv * 4 bytes instead of n_kv * n_head * 4
        ggml_tensor * idx  = ggml_top_k(ctx0, t, st->top_k);                                      // I32 [k, n_head]
        ggml_tensor * val  = ggml_get_rows(ctx0, ggml_reshape_3d(ctx0, t, 1, n_kv, n_head), idx); // [1, k, n_head]
        ggml_tensor * hsum = ggml_sum_rows(ctx0, ggml_cont(ctx0, ggml_transpose(ctx0, t)));      // [1, n_kv]
        ggml_format_name(idx,  "page_probe_topk-%d", il);
        ggml_format_name(val,  "page_probe_topv-%d", il);
        ggml_format_name(hsum, "page_probe_hsum-%d", il);
        for (ggml_tensor * out : { idx, val, hsum }) {
            ggml_set_output(out);
            ggml_build_forward_expand(gf, out);
        }
        st->layers[il] = { t, n_kv, idx, val, hsum };
        return;
    }
    ggml_set_output(t);
    ggml_build_forward_expand(gf, t);

    st->layers[il] = { t, k->ne[1] };
}

void llama_page_decode_end(llama_context * ctx, int32_t ret) {
    tl_build = nullptr;
    probe_state * st = find_state(ctx);
    if (!st || !st->armed) {
        return;
    }
    st->armed = false;
    st->has_result = false;
    st->failure.clear();
    if (ret != 0) {
        st->failure = "the armed llama_decode() failed (returned " + std::to_string(ret) + "); no probe result";
    } else if (!st->batch_error.empty()) {
        st->failure = st->batch_error;
    } else if (st->queries.empty()) {
        st->failure = "the armed batch had no tokens";
    } else {
        try {
            st->failure = collect(ctx, *st);
        } catch (const std::exception & e) {
            st->failure = std::string("internal: ") + e.what();
        }
    }
    st->has_result = st->failure.empty();
    st->layers.clear();
}

void llama_page_context_free(llama_context * ctx) {
    page_park_forget(ctx);
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_states.erase(ctx) > 0) {
        g_n_states.fetch_sub(1);
    }
}

//
// public API
//

int32_t llama_page_probe_arm(llama_context * ctx, llama_seq_id seq_id, int32_t top_k, bool keep_rows) {
    page_set_error("");
    if (int32_t rc = page_check_seq(ctx, seq_id); rc != LLAMA_PAGE_OK) {
        return rc;
    }
    if (top_k < 1) {
        page_set_error("top_k must be >= 1 (got " + std::to_string(top_k) + ")");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    try {
        probe_state & st = get_state(ctx);
        st.armed      = true;
        st.cost_mode  = false;
        st.seq_id     = seq_id;
        st.top_k      = top_k;
        st.keep_rows  = keep_rows;
        st.n_last     = 0;
        st.has_result = false;
        st.failure.clear();
    } catch (const std::exception & e) {
        page_set_error(std::string("internal: ") + e.what());
        return LLAMA_PAGE_ERR_INTERNAL;
    }
    return LLAMA_PAGE_OK;
}

int32_t llama_page_probe_last_queries(llama_context * ctx, int32_t n_last) {
    page_set_error("");
    if (!ctx) {
        page_set_error("ctx is NULL");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    if (n_last < 0) {
        page_set_error("n_last must be >= 0 (got " + std::to_string(n_last) + ")");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    probe_state * st = find_state(ctx);
    if (!st || !st->armed || st->cost_mode) {
        page_set_error("arm the probe (llama_page_probe_arm) before choosing its queries");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    st->n_last = n_last;
    return LLAMA_PAGE_OK;
}

int32_t llama_page_probe_disarm(llama_context * ctx) {
    page_set_error("");
    if (!ctx) {
        page_set_error("ctx is NULL");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    if (probe_state * st = find_state(ctx)) {
        st->armed = false;
        st->has_result = false;
        st->failure = "the probe was disarmed";
    }
    return LLAMA_PAGE_OK;
}

int32_t llama_page_probe_get_info(const llama_context * ctx, llama_page_probe_info * info) {
    page_set_error("");
    if (!ctx || !info) {
        page_set_error("ctx or info is NULL");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    const probe_state * st = result_of(ctx);
    if (!st) {
        return LLAMA_PAGE_ERR_NO_RESULT;
    }
    info->n_layer  = st->n_layer;
    info->n_head   = st->n_head;
    info->top_k    = st->top_k;
    info->n_pos    = (int32_t) st->positions.size();
    info->n_query  = (int32_t) st->queries.size();
    info->has_rows = st->keep_rows && !st->has_costs ? 1 : 0;
    info->has_costs = st->has_costs ? 1 : 0;
    if (st->has_costs) {
        info->top_k = 0;
    }
    return LLAMA_PAGE_OK;
}

int32_t llama_page_set_out_proj(llama_context * ctx, const float * r, int64_t n) {
    page_set_error("");
    if (!ctx) {
        page_set_error("ctx is NULL");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    const llama_model   & model   = ctx->get_model();
    const llama_hparams & hparams = model.hparams;
    const int32_t n_layer = (int32_t) hparams.n_layer();
    const int64_t n_head  = hparams.n_head(0);
    const int64_t d_v     = hparams.n_embd_head_v();
    try {
        probe_state & st = get_state(ctx);
        if (!r) {
            st.proj.reset();
            st.vn_valid = false;
            return LLAMA_PAGE_OK;
        }
        for (int32_t il = 0; il < n_layer; ++il) {
            if ((int64_t) hparams.n_head(il) != n_head) {
                page_set_error("layers with different head counts are not supported by the deletion-cost probe");
                return LLAMA_PAGE_ERR_UNSUPPORTED;
            }
        }
        const int64_t per_layer = n_head * d_v * d_v;
        if (n != (int64_t) n_layer * per_layer) {
            page_set_error("out_proj: expected n_layer * n_head * d_v * d_v = " + std::to_string(n_layer) + " * " +
                           std::to_string(n_head) + " * " + std::to_string(d_v) + "^2 = " +
                           std::to_string(n_layer * per_layer) + " floats, got " + std::to_string(n));
            return LLAMA_PAGE_ERR_INVALID_ARG;
        }
        for (int64_t i = 0; i < n; ++i) {
            if (!std::isfinite(r[i])) {
                page_set_error("out_proj: the factors contain a non-finite value at index " + std::to_string(i));
                return LLAMA_PAGE_ERR_INVALID_ARG;
            }
        }
        auto proj = std::make_unique<out_proj>();
        proj->d_v     = d_v;
        proj->n_cells = (int64_t) ctx->n_ctx();
        st.vn_valid   = false;
        std::map<ggml_backend_buffer_type_t, ggml_context *> by_buft;
        for (int32_t il = 0; il < n_layer; ++il) {
            ggml_backend_buffer_type_t buft = proj_buft(model, il);
            ggml_context *& c = by_buft[buft];
            if (!c) {
                ggml_init_params params = { ggml_tensor_overhead() * (size_t) n_layer * 3, nullptr, true };
                c = ggml_init(params);
                if (!c) {
                    throw std::runtime_error("ggml_init failed");
                }
                proj->ctxs.push_back(c);
            }
            ggml_tensor * t = ggml_new_tensor_3d(c, GGML_TYPE_F32, d_v, d_v, n_head);
            ggml_format_name(t, "page_out_proj-%d", il);
            proj->r.push_back(t);
            ggml_tensor * gt = ggml_new_tensor_3d(c, GGML_TYPE_F32, d_v, d_v, n_head);
            ggml_format_name(gt, "page_out_proj_gram-%d", il);
            proj->g.push_back(gt);
            ggml_tensor * vn = ggml_new_tensor_2d(c, GGML_TYPE_F32, proj->n_cells, n_head);
            ggml_format_name(vn, "page_value_norms-%d", il);
            proj->vn.push_back(vn);
        }
        for (auto & [buft, c] : by_buft) {
            ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(c, buft);
            if (!buf) {
                page_set_error(std::string("out_proj: could not allocate the factors in ") + ggml_backend_buft_name(buft));
                return LLAMA_PAGE_ERR_INTERNAL;
            }
            proj->bufs.push_back(buf);
        }
        std::vector<float> gram((size_t) per_layer);
        for (int32_t il = 0; il < n_layer; ++il) {
            const float * rl = r + (size_t) il * per_layer;
            ggml_backend_tensor_set(proj->r[il], rl, 0, (size_t) per_layer * sizeof(float));
            // G_h = R_h^T R_h once here, not in every armed graph (R_h row-major: R_h[row][col] = rh[row * d_v + col])
            for (int64_t h = 0; h < n_head; ++h) {
                const float * rh = rl + (size_t) h * d_v * d_v;
                float * gh = gram.data() + (size_t) h * d_v * d_v;
                for (int64_t i = 0; i < d_v; ++i) {
                    for (int64_t j = i; j < d_v; ++j) {
                        double acc = 0.0;
                        for (int64_t k = 0; k < d_v; ++k) {
                            acc += (double) rh[k * d_v + i] * rh[k * d_v + j];
                        }
                        gh[i * d_v + j] = gh[j * d_v + i] = (float) acc;
                    }
                }
            }
            ggml_backend_tensor_set(proj->g[il], gram.data(), 0, (size_t) per_layer * sizeof(float));
        }
        st.proj = std::move(proj);
    } catch (const std::exception & e) {
        page_set_error(std::string("internal: ") + e.what());
        return LLAMA_PAGE_ERR_INTERNAL;
    }
    return LLAMA_PAGE_OK;
}

int32_t llama_page_out_proj_weight(const llama_context * ctx, int32_t il, float * out, int64_t n) {
    page_set_error("");
    if (!ctx) {
        page_set_error("ctx is NULL");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    const llama_model & model = ctx->get_model();
    if (il < 0 || il >= (int32_t) model.layers.size()) {
        page_set_error("layer " + std::to_string(il) + " out of range (the model has " + std::to_string(model.layers.size()) + ")");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    const ggml_tensor * wo = model.layers[il].wo;
    if (!wo || !wo->buffer || ggml_n_dims(wo) != 2) {
        page_set_error("layer " + std::to_string(il) + " has no standard attention output projection (attn_output.weight)");
        return LLAMA_PAGE_ERR_UNSUPPORTED;
    }
    if (!out && n == 0) {
        return (int32_t) wo->ne[0];
    }
    if (!out || n != ggml_nelements(wo)) {
        page_set_error("out_proj_weight: destination holds " + std::to_string(n) + " floats, W_O has " +
                       std::to_string(ggml_nelements(wo)) + " (" + std::to_string(wo->ne[1]) + " x " + std::to_string(wo->ne[0]) + ")");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    // the CPU backend may have repacked the weight into an interleaved layout it cannot read back
    if (std::strcmp(ggml_backend_buft_name(ggml_backend_buffer_get_type(wo->buffer)), "CPU_REPACK") == 0) {
        page_set_error("W_O of layer " + std::to_string(il) + " was repacked by the CPU backend and cannot be read back; "
                       "read it from the GGUF file instead");
        return LLAMA_PAGE_ERR_UNSUPPORTED;
    }
    const ggml_type_traits * tt = ggml_get_type_traits(wo->type);
    if (wo->type != GGML_TYPE_F32 && !tt->to_float) {
        page_set_error(std::string("W_O has type ") + ggml_type_name(wo->type) + ", which ggml cannot convert to f32");
        return LLAMA_PAGE_ERR_UNSUPPORTED;
    }
    try {
        std::vector<uint8_t> row(ggml_row_size(wo->type, wo->ne[0]));
        for (int64_t r = 0; r < wo->ne[1]; ++r) {
            ggml_backend_tensor_get(wo, row.data(), (size_t) r * wo->nb[1], row.size());
            float * dst = out + r * wo->ne[0];
            if (wo->type == GGML_TYPE_F32) {
                std::memcpy(dst, row.data(), row.size());
            } else {
                tt->to_float(row.data(), dst, wo->ne[0]);
            }
        }
    } catch (const std::exception & e) {
        page_set_error(std::string("internal: ") + e.what());
        return LLAMA_PAGE_ERR_INTERNAL;
    }
    return LLAMA_PAGE_OK;
}

int32_t llama_page_probe_arm_cost(llama_context * ctx, llama_seq_id target_seq, bool reuse_value_norms) {
    page_set_error("");
    if (int32_t rc = page_check_seq(ctx, target_seq); rc != LLAMA_PAGE_OK) {
        return rc;
    }
    try {
        probe_state & st = get_state(ctx);
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
    const probe_state * st = result_of(ctx);
    if (!st) {
        return LLAMA_PAGE_ERR_NO_RESULT;
    }
    if (!st->has_costs) {
        page_set_error("no deletion costs: the last probe was an attention probe (arm it with llama_page_probe_arm_cost)");
        return LLAMA_PAGE_ERR_NO_RESULT;
    }
    return copy_out(st->costs, costs, n, "costs");
}

int32_t llama_page_probe_get_positions(const llama_context * ctx, llama_pos * positions, int64_t n) {
    page_set_error("");
    const probe_state * st = result_of(ctx);
    return st ? copy_out(st->positions, positions, n, "positions") : LLAMA_PAGE_ERR_NO_RESULT;
}

int32_t llama_page_probe_get_queries(const llama_context * ctx, llama_pos * queries, int64_t n) {
    page_set_error("");
    const probe_state * st = result_of(ctx);
    return st ? copy_out(st->queries, queries, n, "queries") : LLAMA_PAGE_ERR_NO_RESULT;
}

int32_t llama_page_probe_get_mean(const llama_context * ctx, float * mean, int64_t n) {
    page_set_error("");
    const probe_state * st = attention_result_of(ctx);
    return st ? copy_out(st->mean, mean, n, "mean") : LLAMA_PAGE_ERR_NO_RESULT;
}

int32_t llama_page_probe_get_topk(const llama_context * ctx, llama_pos * topk_pos, float * topk_score, int64_t n) {
    page_set_error("");
    const probe_state * st = attention_result_of(ctx);
    if (!st) {
        return LLAMA_PAGE_ERR_NO_RESULT;
    }
    if (int32_t rc = copy_out(st->topk_pos, topk_pos, n, "topk_pos"); rc != LLAMA_PAGE_OK) {
        return rc;
    }
    return copy_out(st->topk_score, topk_score, n, "topk_score");
}

int32_t llama_page_probe_get_rows(const llama_context * ctx, float * rows, int64_t n) {
    page_set_error("");
    const probe_state * st = attention_result_of(ctx);
    if (!st) {
        return LLAMA_PAGE_ERR_NO_RESULT;
    }
    if (!st->keep_rows) {
        page_set_error("no per-head rows: arm the probe with keep_rows = true");
        return LLAMA_PAGE_ERR_NO_RESULT;
    }
    return copy_out(st->rows, rows, n, "rows");
}

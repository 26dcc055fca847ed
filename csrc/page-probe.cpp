// page-probe.cpp — the attention probe: the hooks upstream calls, the probe's state per context, and the
// attention scores with their top-k (see llama-page.h for the contract).
//
// Arming a probe makes the next llama_decode() build its graph with, per attention layer, one
// side branch: softmax(q k^T * scale + mask) for the batch's queries (the same ops the non-flash
// attention path uses, so it holds for flash attention on or off), summed over the queries:
//     F32 [n_kv, n_head]   per layer, marked as a graph output.
// After the decode those sums are copied to the host, cells are mapped to positions through the
// layer's own KV cache (the SWA cache for sliding-window layers), and the top-k per head is taken.
// The deletion-cost mode (llama_page_probe_arm_cost) goes through the same hooks and the same softmax;
// its branch and its result are LORE-KV's (page-lorekv.cpp). Only ops that the CPU, CUDA and Metal
// backends all implement are used (mul_mat, tanh/scale/add, soft_max_ext, permute + cont, sum_rows).

#include "llama-page.h"
#include "page-hooks.h"
#include "page-probe.h"
#include "page-state.h"

#include "llama-context.h"
#include "llama-hparams.h"
#include "llama-model.h"
#include "llama-batch.h"
#include "llama-kv-cache.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

std::mutex                                                  g_mutex;
std::unordered_map<const llama_context *, page_probe_state> g_states;
std::atomic<int>                                            g_n_states{0};

// the state whose probe graph is being built on this thread (set between ubatch_begin and decode_end)
thread_local page_probe_state * tl_build = nullptr;

} // namespace

page_probe_state * page_probe_find(const llama_context * ctx) {
    if (g_n_states.load(std::memory_order_relaxed) == 0) {
        return nullptr;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_states.find(ctx);
    return it == g_states.end() ? nullptr : &it->second;
}

page_probe_state & page_probe_get(const llama_context * ctx) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_states.find(ctx);
    if (it == g_states.end()) {
        it = g_states.emplace(ctx, page_probe_state{}).first;
        g_n_states.fetch_add(1);
    }
    return it->second;
}

const page_probe_state * page_probe_result(const llama_context * ctx) {
    if (!ctx) {
        return nullptr;
    }
    const page_probe_state * st = page_probe_find(ctx);
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

namespace {

const page_probe_state * attention_result_of(const llama_context * ctx) {
    const page_probe_state * st = page_probe_result(ctx);
    if (st && st->has_costs) {
        page_set_error("the last probe computed deletion costs; attention scores need llama_page_probe_arm");
        return nullptr;
    }
    return st;
}

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

// A layer reduced on its device: the head sums give the mean, the device's per-head top-k (over every
// cell, in no order) is filtered to the cells this layer's queries see and sorted as the host path
// sorts (descending score, then ascending position). Scores are those of the host path; only which of
// several exactly equal scores make the cut can differ.
void collect_reduced(page_probe_state & st, int32_t il, const std::vector<std::pair<llama_pos, uint32_t>> & visible,
                     const std::vector<llama_pos> & all, int32_t n_head, int32_t n_query) {
    const page_layer_capture & lc = st.layers[il];
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
std::string collect(llama_context * ctx, page_probe_state & st) {
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
        return page_lorekv_collect(ctx, st);
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
        const page_layer_capture & lc = st.layers[il];
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

} // namespace

//
// hooks called from upstream (csrc/patches/01-probe-hooks.patch)
//

void llama_page_decode_begin(llama_context * ctx) {
    page_probe_state * st = page_probe_find(ctx);
    if (!st || !st->armed) {
        return;
    }
    st->n_ubatch = 0;
    st->batch_error.clear();
    st->queries.clear();
    st->layers.assign(ctx->get_model().hparams.n_layer(), page_layer_capture{});
}

bool llama_page_ubatch_begin(llama_context * ctx, const llama_ubatch & ubatch) {
    tl_build = nullptr;
    page_probe_state * st = page_probe_find(ctx);
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
    page_probe_state * st = tl_build;
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
        ggml_tensor * t = page_lorekv_build(ctx0, gf, *st, kq, v, v_trans, il);
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
    page_probe_state * st = page_probe_find(ctx);
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
        page_probe_state & st = page_probe_get(ctx);
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
    page_probe_state * st = page_probe_find(ctx);
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
    if (page_probe_state * st = page_probe_find(ctx)) {
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
    const page_probe_state * st = page_probe_result(ctx);
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

int32_t llama_page_probe_get_positions(const llama_context * ctx, llama_pos * positions, int64_t n) {
    page_set_error("");
    const page_probe_state * st = page_probe_result(ctx);
    return st ? page_copy_out(st->positions, positions, n, "positions") : LLAMA_PAGE_ERR_NO_RESULT;
}

int32_t llama_page_probe_get_queries(const llama_context * ctx, llama_pos * queries, int64_t n) {
    page_set_error("");
    const page_probe_state * st = page_probe_result(ctx);
    return st ? page_copy_out(st->queries, queries, n, "queries") : LLAMA_PAGE_ERR_NO_RESULT;
}

int32_t llama_page_probe_get_mean(const llama_context * ctx, float * mean, int64_t n) {
    page_set_error("");
    const page_probe_state * st = attention_result_of(ctx);
    return st ? page_copy_out(st->mean, mean, n, "mean") : LLAMA_PAGE_ERR_NO_RESULT;
}

int32_t llama_page_probe_get_topk(const llama_context * ctx, llama_pos * topk_pos, float * topk_score, int64_t n) {
    page_set_error("");
    const page_probe_state * st = attention_result_of(ctx);
    if (!st) {
        return LLAMA_PAGE_ERR_NO_RESULT;
    }
    if (int32_t rc = page_copy_out(st->topk_pos, topk_pos, n, "topk_pos"); rc != LLAMA_PAGE_OK) {
        return rc;
    }
    return page_copy_out(st->topk_score, topk_score, n, "topk_score");
}

int32_t llama_page_probe_get_rows(const llama_context * ctx, float * rows, int64_t n) {
    page_set_error("");
    const page_probe_state * st = attention_result_of(ctx);
    if (!st) {
        return LLAMA_PAGE_ERR_NO_RESULT;
    }
    if (!st->keep_rows) {
        page_set_error("no per-head rows: arm the probe with keep_rows = true");
        return LLAMA_PAGE_ERR_NO_RESULT;
    }
    return page_copy_out(st->rows, rows, n, "rows");
}

// page-probe.h — the probe's state per context, shared by the three files that fill it (not part of the C API):
//   page-probe.cpp   the hooks, the state of each context, the attention scores and their top-k
//   page-lorekv.cpp  LORE-KV's deletion costs: their branch of the armed graph and their result
//   page-outproj.cpp the output-projection factors R_h that the deletion costs read, and W_O read back
// One state per context because one armed decode carries either kind of probe: the hooks are written once.
#pragma once

#include "llama-page.h"
#include "page-state.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

struct llama_context;

// What the armed graph leaves for one layer, read after the decode.
struct page_layer_capture {
    ggml_tensor * sum  = nullptr; // F32 [n_kv, n_head]: softmax summed over the batch's queries
                                  // (cost mode: F32 [n_kv, n_query], deletion cost summed over heads)
    int64_t       n_kv = 0;
    // a layer on a remote (RPC) device, rows not kept: what is read back instead of `sum`, reduced
    // on the device so that little crosses the wire
    ggml_tensor * top_idx  = nullptr; // I32 [k, n_head]: each head's k largest cells, in no order
    ggml_tensor * top_val  = nullptr; // F32 [1, k, n_head]: their sums
    ggml_tensor * head_sum = nullptr; // F32 [1, n_kv]: the sums added over the heads
};

// R_h factors of the output projection, one F32 [d_v, d_v, n_head] tensor per layer (row-major R_h),
// on the device that holds the layer's W_O; beside them, per layer, F32 [n_ctx, n_head]: ||R_h v||^2
// of every cell's value, cached by the first cost decode of a lookahead (the prompt's values do not
// change while futures are decoded, and this d_v^2-per-cell product is the probe's dominant cost).
// Made by llama_page_set_out_proj (page-outproj.cpp), read by the cost branch (page-lorekv.cpp).
struct page_out_proj {
    std::vector<ggml_context *>         ctxs;
    std::vector<ggml_backend_buffer_t>  bufs;
    std::vector<ggml_tensor *>          r;
    std::vector<ggml_tensor *>          g;  // F32 [d_v, d_v, n_head] per layer: G_h = R_h^T R_h (symmetric)
    std::vector<ggml_tensor *>          vn;
    int64_t                             d_v = 0;
    int64_t                             n_cells = 0; // rows of vn

    page_out_proj() = default;
    page_out_proj(const page_out_proj &) = delete;
    page_out_proj & operator=(const page_out_proj &) = delete;
    ~page_out_proj(); // frees the buffers and contexts (page-outproj.cpp)
};

struct page_probe_state {
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
    std::unique_ptr<page_out_proj> proj;

    // the armed decode
    int                             n_ubatch    = 0;
    std::string                     batch_error;
    std::vector<llama_pos>          queries;
    std::vector<page_layer_capture> layers;
    bool                            graph_has_probe = false;

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

// --- the state of each context (page-probe.cpp) ---

// the state of ctx, or nullptr if none was made (cheap when no context has one: no lock is taken)
page_probe_state * page_probe_find(const llama_context * ctx);

// the state of ctx, made empty on first use; may throw (callers catch at the C boundary)
page_probe_state & page_probe_get(const llama_context * ctx);

// the state of ctx when it holds a result; else nullptr, with the error saying why there is none
const page_probe_state * page_probe_result(const llama_context * ctx);

// copy a result array to a caller's buffer of exactly n elements (else LLAMA_PAGE_ERR_INVALID_ARG)
template <typename T>
int32_t page_copy_out(const std::vector<T> & src, T * dst, int64_t n, const char * what) {
    if (!dst || n != (int64_t) src.size()) {
        page_set_error(std::string(what) + ": destination holds " + std::to_string(n) +
                       " elements, the result has " + std::to_string(src.size()));
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    std::copy(src.begin(), src.end(), dst);
    return LLAMA_PAGE_OK;
}

// --- LORE-KV's deletion costs (page-lorekv.cpp), called by the probe's hooks in cost mode ---

// The cost branch of layer il, added to gf (which also gets the value-norm cache's writes): F32 [n_kv, n_query],
// from a = the probe's softmax [n_kv, n_q, n_head] and v as given to build_attn_mha. nullptr after setting
// st.batch_error when the layer has no matching factors.
ggml_tensor * page_lorekv_build(ggml_context * ctx0, ggml_cgraph * gf, page_probe_state & st,
                                ggml_tensor * a, ggml_tensor * v, bool v_trans, int il);

// After the decode: every layer's costs -> st.costs [n_layer, n_query, n_pos]; "" or why there is no result.
std::string page_lorekv_collect(llama_context * ctx, page_probe_state & st);

// page-keys.cpp — L2 norms of the cached keys of one sequence (for KNorm, Devoto et al. 2024,
// arXiv 2406.11430). RoPE is a rotation and the optional K hadamard rotation is orthogonal, so
// the norm of the cached key equals the norm of the pre-RoPE key.

#include "llama-page.h"
#include "page-state.h"

#include "llama-context.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

int32_t llama_page_key_norms(const llama_context * ctx, llama_seq_id seq_id, float * out, int64_t n) {
    page_set_error("");
    if (int32_t rc = page_check_seq(ctx, seq_id); rc != LLAMA_PAGE_OK) {
        return rc;
    }
    try {
        const llama_hparams & hp = ctx->get_model().hparams;
        const int32_t n_layer   = (int32_t) hp.n_layer();
        const int32_t n_head_kv = (int32_t) hp.n_head_kv(0);

        std::vector<llama_pos> positions;
        for (const auto & pc : page_layer_cache(ctx, -1)->get_cells(seq_id).seq_pos_get(seq_id)) {
            positions.push_back(pc.first);
        }
        const int64_t n_pos = (int64_t) positions.size();
        if (!out || n != (int64_t) n_layer * n_head_kv * n_pos) {
            page_set_error("key norms: destination holds " + std::to_string(n) + " floats, need n_layer * n_head_kv * n_pos = " +
                           std::to_string((int64_t) n_layer * n_head_kv * n_pos));
            return LLAMA_PAGE_ERR_INVALID_ARG;
        }
        std::fill(out, out + n, 0.0f); // positions a sliding-window cache no longer holds stay 0

        std::vector<uint8_t> raw;
        std::vector<float>   row;
        for (int32_t il = 0; il < n_layer; ++il) {
            const llama_kv_cache * kv = page_layer_cache(ctx, il);
            ggml_tensor * k = kv->get_k_storage(il); // [n_embd_k_gqa, kv_size, n_stream]
            if (!k || (int32_t) hp.n_head_kv(il) != n_head_kv || k->ne[0] % n_head_kv != 0) {
                page_set_error("key norms: layer " + std::to_string(il) + " has no regular K cache");
                return LLAMA_PAGE_ERR_UNSUPPORTED;
            }
            const int64_t d       = k->ne[0] / n_head_kv;
            const size_t  row_sz  = ggml_row_size(k->type, k->ne[0]);
            const size_t  strm_sz = k->nb[2];
            const uint32_t strm   = kv->get_stream(seq_id);
            raw.resize(strm_sz);
            ggml_backend_tensor_get(k, raw.data(), strm * strm_sz, strm_sz);
            row.resize(k->ne[0]);
            const auto * traits = ggml_get_type_traits(k->type);
            for (const auto & [pos, cell] : kv->get_cells(seq_id).seq_pos_get(seq_id)) {
                const int64_t ip = std::lower_bound(positions.begin(), positions.end(), pos) - positions.begin();
                if (ip >= n_pos || positions[ip] != pos) {
                    continue;
                }
                const uint8_t * src = raw.data() + (size_t) cell * k->nb[1];
                if (k->type == GGML_TYPE_F32) {
                    std::memcpy(row.data(), src, row_sz);
                } else if (traits->to_float) {
                    traits->to_float(src, row.data(), k->ne[0]);
                } else {
                    page_set_error(std::string("key norms: cannot read K cache type ") + ggml_type_name(k->type));
                    return LLAMA_PAGE_ERR_UNSUPPORTED;
                }
                for (int32_t h = 0; h < n_head_kv; ++h) {
                    double s = 0.0;
                    for (int64_t j = 0; j < d; ++j) {
                        s += (double) row[h * d + j] * row[h * d + j];
                    }
                    out[((size_t) il * n_head_kv + h) * n_pos + ip] = (float) std::sqrt(s);
                }
            }
        }
        return LLAMA_PAGE_OK;
    } catch (const std::exception & e) {
        page_set_error(std::string("internal: ") + e.what());
        return LLAMA_PAGE_ERR_INTERNAL;
    }
}

// page-outproj.cpp — the attention output projection, for LORE-KV's deletion costs (see llama-page.h for the
// contract).
//
// A head's deletion cost is measured in the residual stream, through its block W_O^(h) = Q_h R_h of the output
// projection; ||W_O^(h) x|| = ||R_h x||, so only the d_v x d_v factor R_h is needed. The caller computes it (from
// W_O read back here, or from the GGUF file) and hands it over; it is kept on the device of each layer's W_O,
// with its Gram matrix G_h = R_h^T R_h and the cache of value norms that page-lorekv.cpp fills.

#include "llama-page.h"
#include "page-probe.h"
#include "page-state.h"

#include "llama-context.h"
#include "llama-hparams.h"
#include "llama-model.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

page_out_proj::~page_out_proj() {
    for (ggml_backend_buffer_t b : bufs) {
        ggml_backend_buffer_free(b);
    }
    for (ggml_context * c : ctxs) {
        ggml_free(c);
    }
}

namespace {

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

} // namespace

//
// public API
//

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
        page_probe_state & st = page_probe_get(ctx);
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
        auto proj = std::make_unique<page_out_proj>();
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

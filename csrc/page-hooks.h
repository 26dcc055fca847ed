// page-hooks.h — the call sites csrc/patches/01-probe-hooks.patch adds to upstream llama.cpp.
// Kept out of llama-graph.h on purpose: that header is included by every model file.
#pragma once

#include "llama.h"

struct ggml_context;
struct ggml_cgraph;
struct ggml_tensor;
struct llama_context;
struct llama_hparams;
struct llama_ubatch;

// llama_decode(): around ctx->decode(). end() collects the probe result or records the failure.
void llama_page_decode_begin(llama_context * ctx);
void llama_page_decode_end  (llama_context * ctx, int32_t ret);

// llama_context::process_ubatch(): before the graph is built for a ubatch. Returns true when the
// previous graph must not be reused (a probe graph is needed now, or the last one had probe nodes).
bool llama_page_ubatch_begin(llama_context * ctx, const llama_ubatch & ubatch);

// llm_graph_context::build_attn_mha(): q [d, n_tokens, n_head, n_stream], k [d, n_kv, n_head_kv,
// n_stream], v [d_v, n_kv, n_head_kv, n_stream] or, v_trans, [n_kv, d_v, n_head_kv, n_stream] (all
// already permuted), the layer's mask, scale, optional KQ bias and sinks. Adds the probe's side
// computation to gf when a probe is armed for the ubatch being built; else no-op.
void llama_page_probe_attn(ggml_context * ctx0, ggml_cgraph * gf,
        ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, bool v_trans,
        ggml_tensor * kq_b, ggml_tensor * kq_mask, ggml_tensor * sinks,
        float kq_scale, const llama_hparams & hparams, bool grok_softcap, int il);

// ~llama_context(): drop the page-local state of this context.
void llama_page_context_free(llama_context * ctx);

// llama_kv_cache::get_n_kv() (csrc/patches/02): one past the last cell of a stream that the attention must
// cover — the highest cell any sequence other than a parking sequence holds (page-park.cpp); cells held only by
// parking sequences above it are never attended. Without parked cells: cells.used_max_p1().
class llama_kv_cache;
class llama_kv_cells;
uint32_t llama_page_attended_p1(const llama_kv_cache * kv, const llama_kv_cells & cells);

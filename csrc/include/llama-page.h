// llama-page.h — page-local's additions to libllama: an attention probe and sequence-level
// eviction of arbitrary KV positions.
//
// All functions are C, never throw, and report failure through their return value:
//   0 (LLAMA_PAGE_OK) on success, a negative LLAMA_PAGE_ERR_* code otherwise. The message of the
//   last failure on the calling thread is available from llama_page_last_error().
//
// IMPORTANT: llama.h promises that the positions of a sequence are contiguous. After
// llama_page_evict() they are not: kept tokens keep their original positions (no RoPE
// renumbering), so a sequence may hold e.g. positions {0..3, 17, 40..99}. Code that reuses a
// prefix by position (llama-cpp-python's Llama.generate / create_completion, common/ helpers
// that compare n_past with token counts) must never be given an evicted sequence.
// llama_memory_seq_pos_max() still returns the newest position, and a new batch for the
// sequence must start at seq_pos_max + 1 (llama-batch.cpp checks this).
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

enum llama_page_status {
    LLAMA_PAGE_OK              =  0,
    LLAMA_PAGE_ERR_INVALID_ARG = -1, // null pointer, bad seq_id, bad size, ...
    LLAMA_PAGE_ERR_NO_RESULT   = -2, // no probe result: not armed, or the armed decode failed
    LLAMA_PAGE_ERR_UNSUPPORTED = -3, // the context has no (plain or sliding-window) KV cache
    LLAMA_PAGE_ERR_BATCH       = -4, // the armed batch was split into several ubatches or held other sequences
    LLAMA_PAGE_ERR_POSITIONS   = -5, // evict: a position is duplicated or not in the sequence
    LLAMA_PAGE_ERR_INTERNAL    = -6, // unexpected failure inside llama.cpp (message says what)
};

// --- attention probe (csrc/page-probe.cpp) -------------------------------------------------------
// Shape of the probe result of the last armed decode.
struct llama_page_probe_info {
    int32_t n_layer;   // layers of the model (rows of every per-layer array)
    int32_t n_head;    // query heads per layer
    int32_t top_k;     // k of the top-k arrays (as armed; entries beyond n_pos are padding)
    int32_t n_pos;     // visible positions (union over layers), the columns of mean/rows
    int32_t n_query;   // queries in the armed batch
    int32_t has_rows;  // 1 if full per-head rows were kept (armed with keep_rows)
    int32_t has_costs; // 1 for a deletion-cost result (llama_page_probe_arm_cost); mean/top-k/rows are then absent
};

// Arm the probe for the next llama_decode() on this context. That decode must hold only tokens
// of seq_id and fit in one ubatch (n_tokens <= n_ubatch); otherwise it still runs normally but
// the probe reports LLAMA_PAGE_ERR_BATCH. For every layer l and query head h the probe computes
//     s[l,h,p] = mean over the batch's queries q of softmax_p(q . k_p * scale + mask)
// over every KV position p the sequence can see (the batch's own positions causally; sliding-
// window layers see their window), exactly as the model's attention does, whatever its
// flash-attention setting; the main attention path is not changed.
//   top_k     : 1 <= top_k; how many positions to report per (layer, head)
//   keep_rows : also keep the full per-head rows s[l,h,:] (n_layer * n_head * n_pos floats)
// Arming replaces any previous result. The probe disarms itself after one llama_decode().
LLAMA_API int32_t llama_page_probe_arm(struct llama_context * ctx, llama_seq_id seq_id, int32_t top_k, bool keep_rows);

// After llama_page_probe_arm: the probe reads only the armed batch's last n_last queries (0, the default: all
// of them). The batch's other tokens are decoded as usual (so a prompt's last ubatch can carry the probe
// without a batch of its own); the batch must still be one ubatch of seq_id. Refused for an unarmed probe or a
// deletion-cost one; a model with a KQ bias reports LLAMA_PAGE_ERR_BATCH (arm a batch of the queries alone).
LLAMA_API int32_t llama_page_probe_last_queries(struct llama_context * ctx, int32_t n_last);

// Cancel an armed probe and drop any result. Always succeeds for a valid context.
LLAMA_API int32_t llama_page_probe_disarm(struct llama_context * ctx);

// Shape of the current result; LLAMA_PAGE_ERR_NO_RESULT if there is none (never armed, armed but
// not decoded yet, or the armed decode failed — llama_page_last_error() says which).
LLAMA_API int32_t llama_page_probe_get_info(const struct llama_context * ctx, struct llama_page_probe_info * info);

// Copy the result out. Each call checks the size of the destination (in elements).
//   positions : int32 [n_pos]                  visible positions, ascending (llama_pos, never cell indices)
//   queries   : int32 [n_query]                positions of the armed batch's queries
//   mean      : f32   [n_layer, n_pos]         head-mean score of positions[i] in layer l (0 if not visible there)
//   topk_pos  : int32 [n_layer, n_head, top_k] positions by descending score (ties: lower position first);
//   topk_score: f32   [n_layer, n_head, top_k] their scores; padding entries are position -1, score 0
//   rows      : f32   [n_layer, n_head, n_pos] full per-head scores (only if armed with keep_rows)
LLAMA_API int32_t llama_page_probe_get_positions(const struct llama_context * ctx, llama_pos * positions, int64_t n);
LLAMA_API int32_t llama_page_probe_get_queries  (const struct llama_context * ctx, llama_pos * queries,   int64_t n);
LLAMA_API int32_t llama_page_probe_get_mean     (const struct llama_context * ctx, float     * mean,      int64_t n);
LLAMA_API int32_t llama_page_probe_get_topk     (const struct llama_context * ctx, llama_pos * topk_pos, float * topk_score, int64_t n);
LLAMA_API int32_t llama_page_probe_get_rows     (const struct llama_context * ctx, float     * rows,      int64_t n);

// --- deletion cost (LORE-KV; csrc/page-lorekv.cpp) -------------------------------------------------
// For one query in head h with attention a_p over the visible keys and head output o = sum_p a_p v_p,
// deleting key p and renormalising moves the head's contribution to the residual stream by exactly
//     c[h,p] = a_p / (1 - a_p) * || W_O^(h) (v_p - o) ||  =  a_p / (1 - a_p) * || R_h (v_p - o) ||
// where W_O^(h) = Q_h R_h is the QR factorisation of head h's column block of the output projection.
// (1 - a_p is clamped to >= 1e-6.) R_h is supplied by the caller (llama_page_set_out_proj, below), so the same
// probe also computes the "no W_O" (R_h = I) and "per-head gain" (R_h = g_h I) approximations.

// Arm the deletion-cost probe for the next llama_decode(). Every token of that batch is a query, and
// the batch may hold tokens of several sequences (e.g. sampled continuations that share target_seq's
// cells), one sequence per token, in one ubatch. For every layer l and query q the probe computes
//     cost[l, q, p] = sum over query heads h of c[h, p]      (see above)
// for every position p held by target_seq (0 where the query cannot see p). Needs llama_page_set_out_proj.
// The result replaces any previous one; read it with llama_page_probe_get_info (n_pos, n_query,
// has_costs = 1), llama_page_probe_get_positions, llama_page_probe_get_queries and:
//   costs : f32 [n_layer, n_query, n_pos]
// reuse_value_norms: take ||R_h v_p||^2 from the previous cost decode instead of recomputing it (the
// dominant cost: d_v^2 per cell and head). Honoured only when the previous cost decode on this context
// saw exactly the same (position, cell) pairs of target_seq; otherwise they are recomputed. Cells keep
// their values while they hold a position, so this is exact across the steps of one lookahead.
LLAMA_API int32_t llama_page_probe_arm_cost(struct llama_context * ctx, llama_seq_id target_seq, bool reuse_value_norms);
LLAMA_API int32_t llama_page_probe_get_costs(const struct llama_context * ctx, float * costs, int64_t n);

// --- output projection: the factors R_h the deletion cost reads (csrc/page-outproj.cpp) ------------
// Set the factors used by the deletion-cost probe: f32 [n_layer, n_head, d_v, d_v], R_h row-major
// (element [il, h, i, j] = R_h[i][j]); n must equal that size. r == NULL clears them. They are copied to
// the device of each layer's output projection and kept until replaced or the context is freed.
LLAMA_API int32_t llama_page_set_out_proj(struct llama_context * ctx, const float * r, int64_t n);

// Copy layer il's attention output projection W_O, dequantized, into out: f32 [n_embd, n_head * d_v]
// row-major (column block h is head h's W_O^(h)); n must equal that size. For computing R_h.
// out == NULL and n == 0: returns the number of columns (n_head * d_v). LLAMA_PAGE_ERR_UNSUPPORTED when
// the backend cannot read the weight back (the CPU backend's repacked layouts): read the GGUF instead.
LLAMA_API int32_t llama_page_out_proj_weight(const struct llama_context * ctx, int32_t il, float * out, int64_t n);

// --- eviction, positions, key norms and compaction -----------------------------------------------
// Remove exactly the given positions from seq_id, in one call. Cells that other sequences share
// stay for them. The positions may come in any order; each must currently be in the sequence
// (the full-attention cache's view for sliding-window models), with no duplicates, else
// LLAMA_PAGE_ERR_POSITIONS and the cache is unchanged. n == 0 is a no-op.
// Kept tokens keep their positions: the sequence is no longer contiguous (see above).
LLAMA_API int32_t llama_page_evict(struct llama_context * ctx, llama_seq_id seq_id, const llama_pos * positions, int32_t n);

// Copy the positions currently held by seq_id (ascending) into out (capacity n). Returns the
// number of positions (which may exceed n: call again with a larger buffer), or a negative code.
LLAMA_API int32_t llama_page_seq_positions(const struct llama_context * ctx, llama_seq_id seq_id, llama_pos * out, int32_t n);

// L2 norm of every cached key of seq_id, per layer and KV head:
//   out: f32 [n_layer, n_head_kv, n_pos], columns in the order of llama_page_seq_positions().
// Positions that a sliding-window layer's cache no longer holds are 0 in that layer.
LLAMA_API int32_t llama_page_key_norms(const struct llama_context * ctx, llama_seq_id seq_id, float * out, int64_t n);

// Compact, in place, the KV cache stream that holds seq_id (with a unified cache: the whole cache;
// for a sliding-window model both its full-attention and its SWA cache): every used cell, of every
// sequence in the stream, moves down so that the used cells are exactly cells 0..n_used-1, in
// their previous order. K and V rows are copied inside the cache tensors through a host staging
// buffer of about 1 MiB (never the whole cache). Each cell keeps its position, its sequences (a
// cell shared by several sequences stays one shared cell), and any pending shift. The next token
// is placed right after the packed cells. The cells end up as a whole-context llama_state_get_data
// + llama_state_set_data would leave them. What shrinks is the attended range n_kv when eviction
// left holes; next-token outputs are those before compaction up to float rounding (the sums over
// the cache run in another order; bit-identical on CPU with flash attention off and an f16 cache
// in page-local's tests). An already compact stream is left untouched.
//   LLAMA_PAGE_ERR_UNSUPPORTED (nothing was changed): a cross-stream llama_memory_seq_cp is still
//   pending, or a llama_memory_seq_div left a pending shift that cannot be re-created in another
//   cell (run llama_decode once first); or the cache shares its cells with another cache.
// Do not call it while another thread decodes on ctx.
LLAMA_API int32_t llama_page_compact(struct llama_context * ctx, llama_seq_id seq_id);

// --- parking: cells that leave a sequence's attention without leaving memory ---------------------------------
// Park exactly the given positions of seq_id: their cells stay in the cache with their K and V, held by park_seq
// instead of seq_id, so seq_id's attention no longer sees them (a cell seq_id shares with another sequence stays
// that sequence's too). park_seq becomes a parking sequence of this context: the attended range (n_kv) ends at the
// last cell held by any other sequence, so cells held only by parking sequences above it cost a decode nothing.
// Never decode a batch of a parking sequence itself. Then the cells are laid out, moving as few as possible, as
//     [cells of every other sequence, packed from cell 0][at least gap free cells][parked cells][free cells]
// where the parked cells start at a multiple of the attended range's rounding (256 cells), so that a decode of
// seq_id attends over exactly what it would after llama_page_evict + llama_page_compact and never reads a parked
// cell, not even masked (when they do not fit there, they sit as high as they fit). The next tokens go right after
// seq_id's cells; once the gap is full, past the parked cells (correct: the attended range grows to cover them).
// Positions as for llama_page_evict (held by seq_id, no duplicates; else LLAMA_PAGE_ERR_POSITIONS and nothing
// changed); n == 0 only lays the cells out. The gap shrinks to the free cells there are. Parked cells keep their
// positions: they are dropped for good with llama_page_evict(ctx, park_seq, ...) and listed by
// llama_page_seq_positions(ctx, park_seq, ...). Same conditions as llama_page_compact (LLAMA_PAGE_ERR_UNSUPPORTED).
LLAMA_API int32_t llama_page_park(struct llama_context * ctx, llama_seq_id seq_id, llama_seq_id park_seq,
                                  const llama_pos * positions, int32_t n, int32_t gap);

// Return the given positions of park_seq to seq_id, in place (no data moves: the attended range grows to cover
// them); positions == NULL and n < 0: all of them. Each must be held by park_seq and not by seq_id, else
// LLAMA_PAGE_ERR_POSITIONS and nothing changed. Once park_seq holds nothing it is an ordinary sequence again.
// Next-token outputs equal those before parking up to float rounding (the cells may sit in another order).
LLAMA_API int32_t llama_page_restore(struct llama_context * ctx, llama_seq_id seq_id, llama_seq_id park_seq,
                                     const llama_pos * positions, int32_t n);

// Put seq_id's cells in position order from cell 0 (cell k holds its k-th position), as a conversation that was
// never evicted or parked lies: after llama_page_restore of every parked position, the next decode then reads the
// cells in the order a never-parked cache does and its outputs are the same bits. Only for a stream seq_id holds
// alone (no other sequence's cells, no shared cell), else LLAMA_PAGE_ERR_UNSUPPORTED and nothing changed; the
// other conditions of llama_page_compact apply.
LLAMA_API int32_t llama_page_order(struct llama_context * ctx, llama_seq_id seq_id);

// For tests: overwrite the K and V bytes of seq_id's cells at the given positions with 0xFF (NaN in f32, f16 and
// bf16, and in the block scales of quantized types), so that any decode that reads them outputs NaN.
LLAMA_API int32_t llama_page_debug_poison(struct llama_context * ctx, llama_seq_id seq_id, const llama_pos * positions, int32_t n);

// Message of the last failure on this thread ("" if none). Valid until the next llama_page_* call.
LLAMA_API const char * llama_page_last_error(void);

#ifdef __cplusplus
}
#endif

"""The C declarations of csrc/include/llama-page.h, for cffi's ABI mode.

tests/test_bindings.py fails when these drift from the header.
"""

# llama.h types used by the page API
TYPES = """
typedef int32_t llama_pos;
typedef int32_t llama_seq_id;
struct llama_context;
"""

# everything below mirrors llama-page.h (declarations only; comments live in the header)
CDEF = """
enum llama_page_status {
    LLAMA_PAGE_OK              =  0,
    LLAMA_PAGE_ERR_INVALID_ARG = -1,
    LLAMA_PAGE_ERR_NO_RESULT   = -2,
    LLAMA_PAGE_ERR_UNSUPPORTED = -3,
    LLAMA_PAGE_ERR_BATCH       = -4,
    LLAMA_PAGE_ERR_POSITIONS   = -5,
    LLAMA_PAGE_ERR_INTERNAL    = -6,
};

struct llama_page_probe_info {
    int32_t n_layer;
    int32_t n_head;
    int32_t top_k;
    int32_t n_pos;
    int32_t n_query;
    int32_t has_rows;
    int32_t has_costs;
};

int32_t llama_page_probe_arm(struct llama_context * ctx, llama_seq_id seq_id, int32_t top_k, bool keep_rows);
int32_t llama_page_probe_last_queries(struct llama_context * ctx, int32_t n_last);
int32_t llama_page_probe_disarm(struct llama_context * ctx);
int32_t llama_page_probe_get_info(const struct llama_context * ctx, struct llama_page_probe_info * info);
int32_t llama_page_probe_get_positions(const struct llama_context * ctx, llama_pos * positions, int64_t n);
int32_t llama_page_probe_get_queries  (const struct llama_context * ctx, llama_pos * queries,   int64_t n);
int32_t llama_page_probe_get_mean     (const struct llama_context * ctx, float     * mean,      int64_t n);
int32_t llama_page_probe_get_topk     (const struct llama_context * ctx, llama_pos * topk_pos, float * topk_score, int64_t n);
int32_t llama_page_probe_get_rows     (const struct llama_context * ctx, float     * rows,      int64_t n);
int32_t llama_page_set_out_proj(struct llama_context * ctx, const float * r, int64_t n);
int32_t llama_page_out_proj_weight(const struct llama_context * ctx, int32_t il, float * out, int64_t n);
int32_t llama_page_probe_arm_cost(struct llama_context * ctx, llama_seq_id target_seq, bool reuse_value_norms);
int32_t llama_page_probe_get_costs(const struct llama_context * ctx, float * costs, int64_t n);
int32_t llama_page_evict(struct llama_context * ctx, llama_seq_id seq_id, const llama_pos * positions, int32_t n);
int32_t llama_page_seq_positions(const struct llama_context * ctx, llama_seq_id seq_id, llama_pos * out, int32_t n);
int32_t llama_page_key_norms(const struct llama_context * ctx, llama_seq_id seq_id, float * out, int64_t n);
int32_t llama_page_compact(struct llama_context * ctx, llama_seq_id seq_id);
int32_t llama_page_park(struct llama_context * ctx, llama_seq_id seq_id, llama_seq_id park_seq, const llama_pos * positions, int32_t n, int32_t gap);
int32_t llama_page_restore(struct llama_context * ctx, llama_seq_id seq_id, llama_seq_id park_seq, const llama_pos * positions, int32_t n);
int32_t llama_page_order(struct llama_context * ctx, llama_seq_id seq_id);
int32_t llama_page_debug_poison(struct llama_context * ctx, llama_seq_id seq_id, const llama_pos * positions, int32_t n);
const char * llama_page_last_error(void);
"""

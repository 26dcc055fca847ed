// page-state.h — helpers shared by page-probe.cpp and page-evict.cpp (not part of the C API).
#pragma once

#include "llama.h"

#include <string>
#include <utility>
#include <vector>

struct llama_context;
class llama_kv_cache;

// record the message that llama_page_last_error() returns on this thread
void page_set_error(const std::string & msg);

// LLAMA_PAGE_OK if ctx is not NULL and seq_id is a valid sequence of ctx whose memory is a (plain or iSWA) KV cache;
// else sets the error and returns LLAMA_PAGE_ERR_INVALID_ARG / LLAMA_PAGE_ERR_UNSUPPORTED
int32_t page_check_seq(const llama_context * ctx, llama_seq_id seq_id);

// the KV cache that holds layer il (the SWA cache for sliding-window layers of an iSWA model);
// il < 0: the cache that holds every position (the base cache). nullptr if not a KV cache.
const llama_kv_cache * page_layer_cache(const llama_context * ctx, int il);

// the KV caches of ctx: the plain one, or both halves of an iSWA cache (empty if its memory is neither)
std::vector<llama_kv_cache *> page_caches(llama_context * ctx);

// the positions seq_id holds (ascending) in the cache that holds every position; call after page_check_seq
std::vector<llama_pos> page_seq_positions(const llama_context * ctx, llama_seq_id seq_id);

// LLAMA_PAGE_OK if `chosen` (ascending) are distinct positions that `held` (seq_id's, ascending) contains;
// else sets the error and returns LLAMA_PAGE_ERR_POSITIONS
int32_t page_check_positions(const std::vector<llama_pos> & held, const std::vector<llama_pos> & chosen, llama_seq_id seq_id);

// the maximal runs [p0, p1) of held positions that are all chosen (holes between held positions do not split a
// run): one llama_memory_seq_* call per run
std::vector<std::pair<llama_pos, llama_pos>> page_position_runs(const std::vector<llama_pos> & held, const std::vector<llama_pos> & chosen);

// ~llama_context(): forget the parking sequences registered for this context's caches (page-park.cpp)
void page_park_forget(const llama_context * ctx);

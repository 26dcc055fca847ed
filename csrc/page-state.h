// page-state.h — helpers shared by page-probe.cpp and page-evict.cpp (not part of the C API).
#pragma once

#include "llama.h"

#include <string>

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

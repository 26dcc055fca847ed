// page-evict.cpp — sequence-level removal of arbitrary positions and the helpers shared with the
// probe and compaction (see llama-page.h for the contract).

#include "llama-page.h"
#include "page-hooks.h"
#include "page-state.h"

#include "llama-context.h"
#include "llama-kv-cache.h"
#include "llama-model.h"
#include "llama-kv-cache-iswa.h"

#include <algorithm>
#include <string>
#include <vector>

namespace {

thread_local std::string tl_error;

} // namespace

std::vector<llama_pos> page_seq_positions(const llama_context * ctx, llama_seq_id seq_id) {
    std::vector<llama_pos> res;
    const llama_kv_cache * kv = page_layer_cache(ctx, -1);
    for (const auto & pc : kv->get_cells(seq_id).seq_pos_get(seq_id)) {
        res.push_back(pc.first);
    }
    return res;
}

int32_t page_check_positions(const std::vector<llama_pos> & held, const std::vector<llama_pos> & chosen, llama_seq_id seq_id) {
    for (size_t i = 0; i < chosen.size(); ++i) {
        if (i > 0 && chosen[i] == chosen[i - 1]) {
            page_set_error("position " + std::to_string(chosen[i]) + " is given twice");
            return LLAMA_PAGE_ERR_POSITIONS;
        }
        if (!std::binary_search(held.begin(), held.end(), chosen[i])) {
            page_set_error("position " + std::to_string(chosen[i]) + " is not in sequence " + std::to_string(seq_id) +
                           (held.empty() ? std::string(" (the sequence is empty)")
                                         : " (it holds " + std::to_string(held.size()) + " positions in [" +
                                           std::to_string(held.front()) + ", " + std::to_string(held.back()) + "])"));
            return LLAMA_PAGE_ERR_POSITIONS;
        }
    }
    return LLAMA_PAGE_OK;
}

std::vector<std::pair<llama_pos, llama_pos>> page_position_runs(const std::vector<llama_pos> & held, const std::vector<llama_pos> & chosen) {
    // holes between held positions do not split a run, so the number of runs is minimal
    std::vector<std::pair<llama_pos, llama_pos>> runs;
    size_t j = 0; // next chosen position
    size_t i = 0;
    while (i < held.size() && j < chosen.size()) {
        if (held[i] != chosen[j]) {
            ++i;
            continue;
        }
        const llama_pos p0 = held[i];
        while (i < held.size() && j < chosen.size() && held[i] == chosen[j]) {
            ++i;
            ++j;
        }
        runs.emplace_back(p0, held[i - 1] + 1);
    }
    return runs;
}

void page_set_error(const std::string & msg) {
    tl_error = msg;
}

const llama_kv_cache * page_layer_cache(const llama_context * ctx, int il) {
    llama_memory_i * mem = ctx->get_memory();
    if (auto * kv = dynamic_cast<const llama_kv_cache *>(mem)) {
        return kv;
    }
    if (auto * iswa = dynamic_cast<const llama_kv_cache_iswa *>(mem)) {
        const bool swa = il >= 0 && ctx->get_model().hparams.is_swa((uint32_t) il);
        return swa ? iswa->get_swa() : iswa->get_base();
    }
    return nullptr;
}

std::vector<llama_kv_cache *> page_caches(llama_context * ctx) {
    llama_memory_i * mem = ctx->get_memory();
    if (auto * kv = dynamic_cast<llama_kv_cache *>(mem)) {
        return { kv };
    }
    if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        return { iswa->get_base(), iswa->get_swa() };
    }
    return {};
}

int32_t page_check_seq(const llama_context * ctx, llama_seq_id seq_id) {
    if (!ctx) {
        page_set_error("ctx is NULL");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    if (!ctx->get_memory()) {
        page_set_error("this context has no KV cache (an embedding or encoder-only model); page-local needs a decoder with a KV cache");
        return LLAMA_PAGE_ERR_UNSUPPORTED;
    }
    if (!page_layer_cache(ctx, -1)) {
        page_set_error("this model's memory is not a plain or sliding-window KV cache (recurrent or hybrid models are not supported)");
        return LLAMA_PAGE_ERR_UNSUPPORTED;
    }
    const int32_t n_seq = (int32_t) llama_n_seq_max(ctx);
    if (seq_id < 0 || seq_id >= n_seq) {
        page_set_error("seq_id " + std::to_string(seq_id) + " is out of range: this context has sequences 0.." +
                       std::to_string(n_seq - 1));
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    return LLAMA_PAGE_OK;
}

int32_t llama_page_seq_positions(const llama_context * ctx, llama_seq_id seq_id, llama_pos * out, int32_t n) {
    page_set_error("");
    if (!ctx || (n > 0 && !out) || n < 0) {
        page_set_error("ctx is NULL, or out is NULL with n > 0, or n < 0");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    if (int32_t rc = page_check_seq(ctx, seq_id); rc != LLAMA_PAGE_OK) {
        return rc;
    }
    try {
        const std::vector<llama_pos> pos = page_seq_positions(ctx, seq_id);
        std::copy_n(pos.begin(), std::min<size_t>(pos.size(), (size_t) n), out);
        return (int32_t) pos.size();
    } catch (const std::exception & e) {
        page_set_error(std::string("internal: ") + e.what());
        return LLAMA_PAGE_ERR_INTERNAL;
    }
}

int32_t llama_page_evict(llama_context * ctx, llama_seq_id seq_id, const llama_pos * positions, int32_t n) {
    page_set_error("");
    if (!ctx || n < 0 || (n > 0 && !positions)) {
        page_set_error("ctx is NULL, n < 0, or positions is NULL with n > 0");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    if (int32_t rc = page_check_seq(ctx, seq_id); rc != LLAMA_PAGE_OK) {
        return rc;
    }
    if (n == 0) {
        return LLAMA_PAGE_OK;
    }
    try {
        std::vector<llama_pos> evict(positions, positions + n);
        std::sort(evict.begin(), evict.end());

        // validate everything before touching the cache
        const std::vector<llama_pos> held = page_seq_positions(ctx, seq_id);
        if (int32_t rc = page_check_positions(held, evict, seq_id); rc != LLAMA_PAGE_OK) {
            return rc;
        }
        // one llama_memory_seq_rm per maximal run of held positions that are all evicted
        llama_memory_t mem = llama_get_memory(ctx);
        for (const auto & [p0, p1] : page_position_runs(held, evict)) {
            if (!llama_memory_seq_rm(mem, seq_id, p0, p1)) {
                page_set_error("internal: llama_memory_seq_rm refused [" + std::to_string(p0) + ", " + std::to_string(p1) + ")");
                return LLAMA_PAGE_ERR_INTERNAL;
            }
        }
        return LLAMA_PAGE_OK;
    } catch (const std::exception & e) {
        page_set_error(std::string("internal: ") + e.what());
        return LLAMA_PAGE_ERR_INTERNAL;
    }
}

const char * llama_page_last_error(void) {
    return tl_error.c_str();
}

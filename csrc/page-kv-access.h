// page-kv-access.h — page-local's access to llama_kv_cache's private state (cells, heads, tensors), and the
// mover that relocates cells inside the cache tensors. Shared by compaction (page-compact.cpp) and parking
// (page-park.cpp). llama_kv_cache names llama_page_kv_access a friend: csrc/patches/02-cache-operations.patch.
#pragma once

#include "llama-kv-cache.h"
#include "llama-kv-cells.h"

#include "ggml.h"

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

// K/V tensor bytes of one cache layer, as the cache lays them out (llama_kv_cache::get_k/get_v)
struct page_layer_tensor {
    ggml_tensor * t;
    bool          trans; // V without flash attention: [kv_size, n_embd_v_gqa] per stream
};

struct llama_page_kv_access {
    static llama_kv_cells & cells(llama_kv_cache & kv, uint32_t strm) { return kv.v_cells[strm]; }

    // put the search for the next free cells at cell i (0 when i is past the end)
    static void set_head(llama_kv_cache & kv, uint32_t strm, uint32_t i) {
        kv.v_heads[strm] = i < kv.v_cells[strm].size() ? i : 0;
    }

    // the multiple the attended range n_kv is rounded up to (as llama_kv_cache::get_n_kv rounds it)
    static uint32_t attended_pad(const llama_kv_cache & kv) { return std::max(kv.n_pad, 256u); }

    // why the cells of kv cannot be moved now ("" if they can)
    static std::string why_not_movable(const llama_kv_cache & kv) {
        if (kv.other) {
            return "this KV cache shares its cells with another cache; moving its cells is not supported";
        }
        if (!kv.sc_info.empty()) {
            return "a cross-stream sequence copy is pending; run llama_decode once first";
        }
        for (const auto & lt : tensors(kv)) {
            const ggml_tensor * t = lt.t;
            if (t->ne[1] != (int64_t) kv.get_size() || t->ne[2] != (int64_t) kv.get_n_stream() ||
                t->nb[1] != ggml_row_size(t->type, t->ne[0]) || (lt.trans && ggml_blck_size(t->type) != 1)) {
                return std::string("KV tensor ") + t->name + " has a layout page-local does not know";
            }
        }
        return "";
    }

    // the distinct K and V tensors of kv (layers that reuse or share another layer's tensors appear once)
    static std::vector<page_layer_tensor> tensors(const llama_kv_cache & kv) {
        std::vector<page_layer_tensor> res;
        std::set<const ggml_tensor *> seen;
        for (const auto & layer : kv.layers) {
            if (layer.k && seen.insert(layer.k).second) {
                res.push_back({ layer.k, false });
            }
            if (layer.v && seen.insert(layer.v).second) { // no V tensor: MLA
                res.push_back({ layer.v, kv.v_trans });
            }
        }
        return res;
    }
};

// Move cells of one stream: moves[k] = (src, dst). Every destination is empty or the source of another move
// (any permutation among the moved cells and empty ones). K and V bytes of every layer go through host memory
// (all moved rows of one tensor at a time; a transposed V lane at a time), then the cells' metadata (position,
// sequences, extra info, pending shift). Callers check why_not_movable() and synchronize the context first.
void page_move_cells(llama_kv_cache & kv, uint32_t strm, const std::vector<std::pair<uint32_t, uint32_t>> & moves);

// Move only the cells' metadata (position, sequences, extra info, pending shift), as page_move_cells does after
// the bytes; for a caller that moved the bytes itself (compaction's bounded, in-order staging).
void page_move_metadata(llama_kv_cache & kv, uint32_t strm, const std::vector<std::pair<uint32_t, uint32_t>> & moves);

// Why a cell's pending shift cannot be re-created in another cell ("" if it can): upstream's seq_div leaves
// shifts that make the position before the shift negative.
std::string page_check_shifts(const llama_kv_cells & cells, const std::vector<std::pair<uint32_t, uint32_t>> & moves);

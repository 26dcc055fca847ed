// page-park.cpp — parking: cells that leave a sequence's attention without leaving memory (see llama-page.h for
// the contract), and the cell mover it shares with compaction (page-kv-access.h).
//
// A parked cell is held by a parking sequence only. llama.cpp attends over every cell up to the highest used one
// (n_kv), so the attended range would still span parked cells; csrc/patches/02 makes llama_kv_cache::get_n_kv
// end at the highest cell that any other sequence holds (llama_page_attended_p1 below). Parking then lays the
// cells out as [attended cells][gap][parked cells][free]: a decode attends over exactly the cells it would after
// eviction and compaction, and its next tokens fill the gap.

#include "llama-page.h"
#include "page-hooks.h"
#include "page-kv-access.h"
#include "page-state.h"

#include "llama-context.h"
#include "llama-kv-cache.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

using seq_set = llama_kv_cells::seq_set_t;
using cell_moves = std::vector<std::pair<uint32_t, uint32_t>>;

namespace {

// the parking sequences of each cache that has any (a handful of entries: one per cache with parked cells)
std::mutex                                            g_park_mutex;
std::atomic<int>                                      g_park_entries{0};
std::vector<std::pair<const llama_kv_cache *, seq_set>> g_park_table;

seq_set parks_of(const llama_kv_cache * kv) {
    std::lock_guard<std::mutex> lock(g_park_mutex);
    for (const auto & [k, s] : g_park_table) {
        if (k == kv) {
            return s;
        }
    }
    return {};
}

void set_park(const llama_kv_cache * kv, llama_seq_id seq_id, bool on) {
    std::lock_guard<std::mutex> lock(g_park_mutex);
    for (auto it = g_park_table.begin(); it != g_park_table.end(); ++it) {
        if (it->first == kv) {
            it->second.set(seq_id, on);
            if (it->second.none()) {
                g_park_table.erase(it);
                g_park_entries.fetch_sub(1);
            }
            return;
        }
    }
    if (on) {
        seq_set s;
        s.set(seq_id);
        g_park_table.emplace_back(kv, s);
        g_park_entries.fetch_add(1);
    }
}

bool is_parked(const llama_kv_cells & cells, uint32_t i, const seq_set & parks) {
    return !cells.is_empty(i) && (cells.seq_get_all(i) & ~parks).none();
}

// The moves that lay one stream out as [cells other sequences hold][gap][parked][free], moving as few cells as
// possible: a cell already in its region stays. The parked cells start where the attended range, rounded up to
// `pad` cells as get_n_kv rounds it, ends after the gap (or as far up as they fit): the attention never even masks
// them (a masked cell inside the range is still read by the matrix products of the non-flash path).
// n_live: how many cells the first region holds.
cell_moves park_layout(const llama_kv_cells & cells, const seq_set & parks, uint32_t gap, uint32_t pad, uint32_t & n_live) {
    const uint32_t size = cells.size();
    uint32_t n_park = 0;
    n_live = 0;
    for (uint32_t i = 0; i < size; ++i) {
        if (!cells.is_empty(i)) {
            ++(is_parked(cells, i, parks) ? n_park : n_live);
        }
    }
    const uint32_t end = (n_live + gap + pad - 1) / pad * pad;
    const uint32_t p0  = std::max(n_live, std::min(end, size - n_park));
    const uint32_t p1 = p0 + n_park;
    std::vector<uint32_t> live_from, live_to, park_from, park_to;
    for (uint32_t i = 0; i < size; ++i) {
        const bool used   = !cells.is_empty(i);
        const bool parked = used && is_parked(cells, i, parks);
        const bool live   = used && !parked;
        if (i < n_live) {
            if (!live) {
                live_to.push_back(i); // empty, or a parked cell that moves up
            }
        } else if (live) {
            live_from.push_back(i);
        }
        if (i >= p0 && i < p1) {
            if (!parked) {
                park_to.push_back(i); // empty, or a live cell that moves down
            }
        } else if (parked) {
            park_from.push_back(i);
        }
    }
    GGML_ASSERT(live_from.size() == live_to.size() && park_from.size() == park_to.size());
    cell_moves moves;
    for (size_t k = 0; k < live_from.size(); ++k) {
        moves.emplace_back(live_from[k], live_to[k]);
    }
    for (size_t k = 0; k < park_from.size(); ++k) {
        moves.emplace_back(park_from[k], park_to[k]);
    }
    return moves;
}

// the cells of one stream that seq_id holds at the given (ascending) positions
std::vector<uint32_t> cells_at(const llama_kv_cells & cells, llama_seq_id seq_id, const std::vector<llama_pos> & positions) {
    std::vector<uint32_t> res;
    for (const auto & [pos, i] : cells.seq_pos_get(seq_id)) {
        if (std::binary_search(positions.begin(), positions.end(), pos)) {
            res.push_back(i);
        }
    }
    return res;
}

// the checks shared by park and restore
int32_t check_args(llama_context * ctx, llama_seq_id seq_id, llama_seq_id park_seq, const llama_pos * positions, int32_t n,
                   const char * what) {
    if (!ctx || n < 0 || (n > 0 && !positions)) {
        page_set_error(std::string(what) + ": ctx is NULL, n < 0, or positions is NULL with n > 0");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    for (llama_seq_id s : { seq_id, park_seq }) {
        if (int32_t rc = page_check_seq(ctx, s); rc != LLAMA_PAGE_OK) {
            return rc;
        }
    }
    if (seq_id == park_seq) {
        page_set_error(std::string(what) + ": seq_id and park_seq are both " + std::to_string(seq_id) + "; park into another sequence");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    return LLAMA_PAGE_OK;
}

// copy positions of `from` to `to` and remove them from `from`, one pair of calls per run
int32_t hand_over(llama_context * ctx, llama_seq_id from, llama_seq_id to, const std::vector<llama_pos> & held,
                  const std::vector<llama_pos> & chosen) {
    llama_memory_t mem = llama_get_memory(ctx);
    for (const auto & [p0, p1] : page_position_runs(held, chosen)) {
        llama_memory_seq_cp(mem, from, to, p0, p1);
        if (!llama_memory_seq_rm(mem, from, p0, p1)) {
            page_set_error("internal: llama_memory_seq_rm refused [" + std::to_string(p0) + ", " + std::to_string(p1) + ")");
            return LLAMA_PAGE_ERR_INTERNAL;
        }
    }
    return LLAMA_PAGE_OK;
}

} // namespace

// --- the mover (page-kv-access.h) ------------------------------------------------------------------------------

std::string page_check_shifts(const llama_kv_cells & cells, const cell_moves & moves) {
    for (const auto & [src, dst] : moves) {
        // a pending shift moves with the cell, re-created as upstream's seq_cp does: the position before it, then it
        if (cells.pos_get(src) - cells.get_shift(src) < 0) {
            return "cell " + std::to_string(src) + " has a pending position shift (llama_memory_seq_div) that cannot be moved; "
                   "run llama_decode once first";
        }
    }
    return "";
}

void page_move_metadata(llama_kv_cache & kv, uint32_t strm, const cell_moves & moves) {
    llama_kv_cells & cells = llama_page_kv_access::cells(kv, strm);
    struct meta {
        llama_pos         pos;
        llama_pos         shift;
        llama_kv_cell_ext ext;
        seq_set           seqs;
    };
    std::vector<meta> m;
    m.reserve(moves.size());
    for (const auto & [src, dst] : moves) {
        m.push_back({ cells.pos_get(src), cells.get_shift(src), cells.ext_get(src), cells.seq_get_all(src) });
    }
    for (const auto & [src, dst] : moves) { // every source first: a destination may be another move's source
        cells.rm(src);
    }
    for (size_t k = 0; k < moves.size(); ++k) {
        const uint32_t dst = moves[k].second;
        cells.pos_set(dst, m[k].pos - m[k].shift);
        for (llama_seq_id s = 0; s < LLAMA_MAX_SEQ; ++s) {
            if (m[k].seqs.test(s)) {
                cells.seq_add(dst, s);
            }
        }
        if (m[k].shift != 0) {
            cells.pos_add(dst, m[k].shift);
        }
        cells.ext_set(dst, m[k].ext);
    }
}

// the end of the run of moves from k whose sources (src) or destinations (!src) are consecutive cells
static size_t page_run_end(const cell_moves & moves, size_t k, bool src) {
    size_t e = k + 1;
    while (e < moves.size() && (src ? moves[e].first == moves[e - 1].first + 1 : moves[e].second == moves[e - 1].second + 1)) {
        ++e;
    }
    return e;
}

void page_move_cells(llama_kv_cache & kv, uint32_t strm, const cell_moves & moves) {
    if (moves.empty()) {
        return;
    }
    uint32_t lo = UINT32_MAX;
    uint32_t hi = 0;
    for (const auto & [src, dst] : moves) {
        lo = std::min({ lo, src, dst });
        hi = std::max({ hi, src + 1, dst + 1 });
    }
    std::vector<uint8_t> stage;
    std::vector<uint8_t> lane;
    for (const auto & lt : llama_page_kv_access::tensors(kv)) {
        ggml_tensor * t = lt.t;
        const size_t base = (size_t) strm * t->nb[2];
        if (!lt.trans) { // a cell is one row: gather every moved row, then write each where it goes
            // a run of moves whose sources and destinations are both consecutive is one get and one set: on a
            // GPU each call is a copy over the bus (one per row made parking an 8K cache take 4.2 s on an H200)
            const size_t rb = t->nb[1];
            stage.resize(moves.size() * rb);
            for (size_t k = 0; k < moves.size();) {
                const size_t e = page_run_end(moves, k, true);
                ggml_backend_tensor_get(t, stage.data() + k * rb, base + (size_t) moves[k].first * rb, (e - k) * rb);
                k = e;
            }
            for (size_t k = 0; k < moves.size();) {
                const size_t e = page_run_end(moves, k, false);
                ggml_backend_tensor_set(t, stage.data() + k * rb, base + (size_t) moves[k].second * rb, (e - k) * rb);
                k = e;
            }
        } else { // a cell is one element of each lane: move within [lo, hi) of every lane
            const size_t es     = ggml_type_size(t->type);
            const size_t stride = (size_t) kv.get_size() * es;
            lane.resize((size_t) (hi - lo) * es);
            stage.resize(moves.size() * es);
            for (int64_t j = 0; j < t->ne[0]; ++j) {
                const size_t off = base + (size_t) j * stride + (size_t) lo * es;
                ggml_backend_tensor_get(t, lane.data(), off, lane.size());
                for (size_t k = 0; k < moves.size(); ++k) {
                    std::memcpy(stage.data() + k * es, lane.data() + (size_t) (moves[k].first - lo) * es, es);
                }
                for (size_t k = 0; k < moves.size(); ++k) {
                    std::memcpy(lane.data() + (size_t) (moves[k].second - lo) * es, stage.data() + k * es, es);
                }
                ggml_backend_tensor_set(t, lane.data(), off, lane.size());
            }
        }
    }
    page_move_metadata(kv, strm, moves);
}

// --- the attended range (csrc/patches/02: llama_kv_cache::get_n_kv) ---------------------------------------------

uint32_t llama_page_attended_p1(const llama_kv_cache * kv, const llama_kv_cells & cells) {
    uint32_t hi = cells.used_max_p1();
    if (g_park_entries.load(std::memory_order_relaxed) == 0) {
        return hi;
    }
    const seq_set parks = parks_of(kv);
    if (parks.none()) {
        return hi;
    }
    while (hi > 0 && (cells.is_empty(hi - 1) || is_parked(cells, hi - 1, parks))) {
        --hi;
    }
    return hi;
}

void page_park_forget(const llama_context * ctx) {
    std::lock_guard<std::mutex> lock(g_park_mutex);
    for (llama_kv_cache * kv : page_caches(const_cast<llama_context *>(ctx))) {
        for (auto it = g_park_table.begin(); it != g_park_table.end(); ++it) {
            if (it->first == kv) {
                g_park_table.erase(it);
                g_park_entries.fetch_sub(1);
                break;
            }
        }
    }
}

// --- public API ------------------------------------------------------------------------------------------------

int32_t llama_page_park(llama_context * ctx, llama_seq_id seq_id, llama_seq_id park_seq, const llama_pos * positions,
                        int32_t n, int32_t gap) {
    page_set_error("");
    if (int32_t rc = check_args(ctx, seq_id, park_seq, positions, n, "park"); rc != LLAMA_PAGE_OK) {
        return rc;
    }
    if (gap < 0) {
        page_set_error("park: gap must be >= 0 (got " + std::to_string(gap) + ")");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    bool changed = false;
    try {
        std::vector<llama_pos> chosen(positions, positions + n);
        std::sort(chosen.begin(), chosen.end());
        const std::vector<llama_pos> held = page_seq_positions(ctx, seq_id);
        if (int32_t rc = page_check_positions(held, chosen, seq_id); rc != LLAMA_PAGE_OK) {
            return rc;
        }
        const std::vector<llama_kv_cache *> caches = page_caches(ctx);
        for (llama_kv_cache * kv : caches) {
            if (std::string err = llama_page_kv_access::why_not_movable(*kv); !err.empty()) {
                page_set_error("park: " + err + "; nothing was changed");
                return LLAMA_PAGE_ERR_UNSUPPORTED;
            }
        }
        for (llama_kv_cache * kv : caches) {
            set_park(kv, park_seq, true);
        }
        changed = true;
        if (int32_t rc = hand_over(ctx, seq_id, park_seq, held, chosen); rc != LLAMA_PAGE_OK) {
            return rc;
        }
        llama_synchronize(ctx); // no decode may still be writing the cache
        for (llama_kv_cache * kv : caches) {
            const uint32_t strm = kv->get_stream(seq_id);
            const seq_set parks = parks_of(kv);
            uint32_t n_live = 0;
            const cell_moves moves = park_layout(llama_page_kv_access::cells(*kv, strm), parks, (uint32_t) gap,
                                                 llama_page_kv_access::attended_pad(*kv), n_live);
            if (std::string err = page_check_shifts(llama_page_kv_access::cells(*kv, strm), moves); !err.empty()) {
                page_set_error("park: the positions are parked but their cells stay where they were (decoding is as slow as "
                               "with the cells held): " + err);
                return LLAMA_PAGE_ERR_UNSUPPORTED;
            }
            page_move_cells(*kv, strm, moves);
            llama_page_kv_access::set_head(*kv, strm, n_live);
        }
        return LLAMA_PAGE_OK;
    } catch (const std::exception & e) {
        page_set_error(std::string("park: internal: ") + e.what() +
                       (changed ? "; the KV cache may be partly moved and must be cleared" : "; nothing was changed"));
        return LLAMA_PAGE_ERR_INTERNAL;
    }
}

int32_t llama_page_restore(llama_context * ctx, llama_seq_id seq_id, llama_seq_id park_seq, const llama_pos * positions,
                           int32_t n) {
    page_set_error("");
    const bool all = positions == nullptr && n < 0;
    if (int32_t rc = check_args(ctx, seq_id, park_seq, positions, all ? 0 : n, "restore"); rc != LLAMA_PAGE_OK) {
        return rc;
    }
    try {
        const std::vector<llama_pos> parked = page_seq_positions(ctx, park_seq);
        std::vector<llama_pos> chosen = all ? parked : std::vector<llama_pos>(positions, positions + n);
        std::sort(chosen.begin(), chosen.end());
        if (int32_t rc = page_check_positions(parked, chosen, park_seq); rc != LLAMA_PAGE_OK) {
            return rc;
        }
        const std::vector<llama_pos> held = page_seq_positions(ctx, seq_id);
        for (llama_pos p : chosen) {
            if (std::binary_search(held.begin(), held.end(), p)) {
                page_set_error("restore: sequence " + std::to_string(seq_id) + " already holds position " + std::to_string(p) +
                               "; a restored cell would share it (nothing was changed)");
                return LLAMA_PAGE_ERR_POSITIONS;
            }
        }
        if (int32_t rc = hand_over(ctx, park_seq, seq_id, parked, chosen); rc != LLAMA_PAGE_OK) {
            return rc;
        }
        if (page_seq_positions(ctx, park_seq).empty()) { // an empty parking sequence is an ordinary one again
            for (llama_kv_cache * kv : page_caches(ctx)) {
                set_park(kv, park_seq, false);
            }
        }
        return LLAMA_PAGE_OK;
    } catch (const std::exception & e) {
        page_set_error(std::string("restore: internal: ") + e.what());
        return LLAMA_PAGE_ERR_INTERNAL;
    }
}

int32_t llama_page_order(llama_context * ctx, llama_seq_id seq_id) {
    page_set_error("");
    if (!ctx) {
        page_set_error("order: ctx is NULL");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    if (int32_t rc = page_check_seq(ctx, seq_id); rc != LLAMA_PAGE_OK) {
        return rc;
    }
    try {
        const std::vector<llama_kv_cache *> caches = page_caches(ctx);
        // first every check, so that a refusal changes nothing
        std::vector<cell_moves> plan;
        for (llama_kv_cache * kv : caches) {
            if (std::string err = llama_page_kv_access::why_not_movable(*kv); !err.empty()) {
                page_set_error("order: " + err + "; nothing was changed");
                return LLAMA_PAGE_ERR_UNSUPPORTED;
            }
            const uint32_t strm = kv->get_stream(seq_id);
            const llama_kv_cells & cells = llama_page_kv_access::cells(*kv, strm);
            const auto & by_pos = cells.seq_pos_get(seq_id); // (pos, cell), ordered by position
            if (by_pos.size() != cells.get_used()) {
                page_set_error("order: other sequences hold cells of this stream; only a stream that sequence " +
                               std::to_string(seq_id) + " holds alone is put in order (nothing was changed)");
                return LLAMA_PAGE_ERR_UNSUPPORTED;
            }
            cell_moves moves;
            uint32_t k = 0;
            for (const auto & [pos, cell] : by_pos) {
                if (cells.seq_get_all(cell).count() != 1) {
                    page_set_error("order: a cell of sequence " + std::to_string(seq_id) +
                                   " is shared with another sequence (nothing was changed)");
                    return LLAMA_PAGE_ERR_UNSUPPORTED;
                }
                if (cell != k) {
                    moves.emplace_back(cell, k);
                }
                ++k;
            }
            if (std::string err = page_check_shifts(cells, moves); !err.empty()) {
                page_set_error("order: " + err + " (nothing was changed)");
                return LLAMA_PAGE_ERR_UNSUPPORTED;
            }
            plan.push_back(std::move(moves));
        }
        llama_synchronize(ctx); // no decode may still be writing the cache
        for (size_t c = 0; c < caches.size(); ++c) {
            const uint32_t strm = caches[c]->get_stream(seq_id);
            page_move_cells(*caches[c], strm, plan[c]);
            llama_page_kv_access::set_head(*caches[c], strm,
                                           (uint32_t) llama_page_kv_access::cells(*caches[c], strm).get_used());
        }
        return LLAMA_PAGE_OK;
    } catch (const std::exception & e) {
        page_set_error(std::string("order: internal: ") + e.what() + "; the KV cache may be partly moved and must be cleared");
        return LLAMA_PAGE_ERR_INTERNAL;
    }
}

int32_t llama_page_debug_poison(llama_context * ctx, llama_seq_id seq_id, const llama_pos * positions, int32_t n) {
    page_set_error("");
    if (!ctx || n < 0 || (n > 0 && !positions)) {
        page_set_error("poison: ctx is NULL, n < 0, or positions is NULL with n > 0");
        return LLAMA_PAGE_ERR_INVALID_ARG;
    }
    if (int32_t rc = page_check_seq(ctx, seq_id); rc != LLAMA_PAGE_OK) {
        return rc;
    }
    try {
        std::vector<llama_pos> chosen(positions, positions + n);
        std::sort(chosen.begin(), chosen.end());
        if (int32_t rc = page_check_positions(page_seq_positions(ctx, seq_id), chosen, seq_id); rc != LLAMA_PAGE_OK) {
            return rc;
        }
        llama_synchronize(ctx);
        for (llama_kv_cache * kv : page_caches(ctx)) {
            const uint32_t strm = kv->get_stream(seq_id);
            const std::vector<uint32_t> idx = cells_at(llama_page_kv_access::cells(*kv, strm), seq_id, chosen);
            for (const auto & lt : llama_page_kv_access::tensors(*kv)) {
                ggml_tensor * t = lt.t;
                const size_t base = (size_t) strm * t->nb[2];
                const size_t es   = ggml_type_size(t->type);
                const std::vector<uint8_t> ones(lt.trans ? es : t->nb[1], 0xFF); // NaN in f32/f16/bf16 and in block scales
                for (uint32_t i : idx) {
                    if (!lt.trans) {
                        ggml_backend_tensor_set(t, ones.data(), base + (size_t) i * t->nb[1], ones.size());
                    } else {
                        for (int64_t j = 0; j < t->ne[0]; ++j) {
                            ggml_backend_tensor_set(t, ones.data(), base + ((size_t) j * kv->get_size() + i) * es, es);
                        }
                    }
                }
            }
        }
        return LLAMA_PAGE_OK;
    } catch (const std::exception & e) {
        page_set_error(std::string("poison: internal: ") + e.what());
        return LLAMA_PAGE_ERR_INTERNAL;
    }
}

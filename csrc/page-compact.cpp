// page-compact.cpp — in-place compaction of the KV cache (see llama-page.h for the contract).
//
// llama.cpp attends over every cell up to the highest used one (n_kv = used_max_p1, padded), so
// the holes that eviction leaves keep decoding as slow as the full cache. Compaction moves the
// used cells of a stream down to cells 0..n_used-1, keeping their order: cell src[k] (the k-th
// used cell at or above the first hole lo) moves to lo + k. Since lo + k <= src[k], a move never
// overwrites a cell that is still to be read when the cells are processed in ascending order.
//
// The K and V rows of every layer are copied inside the existing cache tensors through a bounded
// host staging buffer (ggml_backend_tensor_get/set: any backend), then the cell metadata (position,
// sequence bits, extra info, pending shift) is moved with llama_kv_cells' own methods.

#include "llama-page.h"
#include "page-kv-access.h"
#include "page-state.h"

#include "llama-context.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

namespace {

// Host staging per get/set call. A chunk always holds at least one cell's row (K, or V with flash
// attention) or one cache-long lane (transposed V), so a huge row is the only way to exceed it.
// PAGE_LOCAL_COMPACT_STAGING (bytes) overrides it; the tests use a tiny value to exercise chunking.
constexpr size_t STAGING_BYTES = 1u << 20;

size_t staging_bytes() {
    if (const char * s = std::getenv("PAGE_LOCAL_COMPACT_STAGING")) {
        const long long v = std::atoll(s);
        if (v > 0) {
            return (size_t) v;
        }
    }
    return STAGING_BYTES;
}

// which cells of one stream of one cache move where
struct move_plan {
    llama_kv_cache *      kv   = nullptr;
    uint32_t              strm = 0;
    uint32_t              lo   = 0; // first empty cell: cells [0, lo) are used and stay
    uint32_t              hi   = 0; // one past the last used cell
    std::vector<uint32_t> src;      // the used cells >= lo, ascending; src[k] moves to lo + k
};

// Move the used cells of one lane down: cell i of the lane lives at byte offset base + i*elem.
// Source windows of at most `cap` bytes are read in ascending order; the cells used in a window
// are gathered at the front of the buffer and written to their destinations in one call. The
// destinations of window w end at or below the start of window w+1, so no unread cell is lost.
void pack_lane(ggml_tensor * t, size_t base, size_t elem, const move_plan & p, std::vector<uint8_t> & buf) {
    const size_t cap_cells = std::max<size_t>(1, buf.size() / elem);
    size_t k = 0;
    while (k < p.src.size()) {
        const uint32_t a = p.src[k];
        size_t k_end = k;
        while (k_end < p.src.size() && p.src[k_end] - a < cap_cells) {
            ++k_end;
        }
        const uint32_t b = p.src[k_end - 1] + 1; // read [a, b): the window's last used cell ends it
        ggml_backend_tensor_get(t, buf.data(), base + (size_t) a * elem, (size_t) (b - a) * elem);
        for (size_t i = k; i < k_end; ++i) { // gather; destination offset (i - k) <= source offset
            if (p.src[i] - a != i - k) {
                std::memmove(buf.data() + (i - k) * elem, buf.data() + (size_t) (p.src[i] - a) * elem, elem);
            }
        }
        ggml_backend_tensor_set(t, buf.data(), base + (size_t) (p.lo + k) * elem, (k_end - k) * elem);
        k = k_end;
    }
}

// Transposed V: lane j (one channel over every cell) starts at base + j*stride, cell i at +i*es.
// Groups of whole lanes are staged together ([lo, hi) of each, with what lies between), packed in
// the buffer and written back as they were read: cells past the packed ones keep their old bytes.
// A lane longer than the staging buffer is packed on its own, chunked by cells.
void pack_lanes_transposed(ggml_tensor * t, size_t base, size_t es, size_t stride, int64_t n_lanes,
                           const move_plan & p, std::vector<uint8_t> & buf) {
    if (stride > buf.size()) {
        for (int64_t j = 0; j < n_lanes; ++j) {
            pack_lane(t, base + (size_t) j * stride, es, p, buf);
        }
        return;
    }
    const int64_t group = (int64_t) (buf.size() / stride);
    for (int64_t j0 = 0; j0 < n_lanes; j0 += group) {
        const int64_t j1    = std::min(n_lanes, j0 + group);
        const size_t  first = base + (size_t) j0 * stride + (size_t) p.lo * es;
        const size_t  size  = (size_t) (j1 - j0 - 1) * stride + (size_t) (p.hi - p.lo) * es;
        ggml_backend_tensor_get(t, buf.data(), first, size);
        for (int64_t j = j0; j < j1; ++j) {
            uint8_t * lane = buf.data() + (size_t) (j - j0) * stride; // cell i at lane + (i - lo)*es
            size_t k = 0;
            while (k < p.src.size()) { // one memmove per run of consecutive source cells
                size_t n = 1;
                while (k + n < p.src.size() && p.src[k + n] == p.src[k] + n) {
                    ++n;
                }
                std::memmove(lane + k * es, lane + (size_t) (p.src[k] - p.lo) * es, n * es);
                k += n;
            }
        }
        ggml_backend_tensor_set(t, buf.data(), first, size);
    }
}

// the plan for one stream of kv, or an error message if the cache cannot be compacted now
std::string plan(llama_kv_cache & kv, uint32_t strm, move_plan & p) {
    if (std::string err = llama_page_kv_access::why_not_movable(kv); !err.empty()) {
        return err;
    }
    const llama_kv_cells & cells = llama_page_kv_access::cells(kv, strm);
    p.kv   = &kv;
    p.strm = strm;
    p.hi   = cells.used_max_p1();
    p.lo   = 0;
    while (p.lo < p.hi && !cells.is_empty(p.lo)) {
        ++p.lo;
    }
    std::vector<std::pair<uint32_t, uint32_t>> moves;
    for (uint32_t i = p.lo; i < p.hi; ++i) {
        if (!cells.is_empty(i)) {
            moves.emplace_back(i, p.lo + (uint32_t) p.src.size());
            p.src.push_back(i);
        }
    }
    return page_check_shifts(cells, moves);
}

// move the K/V bytes of every layer
void move_data(const move_plan & p, std::vector<uint8_t> & buf) {
    const llama_kv_cache & kv = *p.kv;
    for (const auto & lt : llama_page_kv_access::tensors(kv)) {
        ggml_tensor * t = lt.t;
        const size_t base = (size_t) p.strm * t->nb[2];
        if (lt.trans) {
            const size_t es = ggml_type_size(t->type);
            pack_lanes_transposed(t, base, es, (size_t) kv.get_size() * es, t->ne[0], p, buf);
        } else {
            pack_lane(t, base, t->nb[1], p, buf);
        }
    }
}

size_t max_row_bytes(const llama_kv_cache & kv) {
    size_t res = 0;
    for (const auto & lt : llama_page_kv_access::tensors(kv)) {
        res = std::max(res, lt.trans ? ggml_type_size(lt.t->type) : lt.t->nb[1]);
    }
    return res;
}

} // namespace

int32_t llama_page_compact(llama_context * ctx, llama_seq_id seq_id) {
    page_set_error("");
    if (int32_t rc = page_check_seq(ctx, seq_id); rc != LLAMA_PAGE_OK) {
        return rc;
    }
    bool moved = false;
    try {
        // the caches to compact: the plain one, or both halves of an iSWA cache
        const std::vector<llama_kv_cache *> caches = page_caches(ctx);

        // plan everything and allocate the staging buffer before anything is touched
        std::vector<move_plan> plans;
        size_t row_max = 0;
        for (llama_kv_cache * kv : caches) {
            move_plan p;
            const std::string err = plan(*kv, kv->get_stream(seq_id), p);
            if (!err.empty()) {
                page_set_error("compact: " + err + "; nothing was changed");
                return LLAMA_PAGE_ERR_UNSUPPORTED;
            }
            if (!p.src.empty()) { // else already compact: a no-op
                row_max = std::max(row_max, max_row_bytes(*kv));
                plans.push_back(std::move(p));
            }
        }
        if (plans.empty()) {
            return LLAMA_PAGE_OK;
        }
        std::vector<uint8_t> buf(std::max(staging_bytes(), row_max));

        llama_synchronize(ctx); // no decode may still be writing the cache
        moved = true;
        for (const move_plan & p : plans) {
            move_data(p, buf);
            std::vector<std::pair<uint32_t, uint32_t>> moves;
            for (size_t k = 0; k < p.src.size(); ++k) {
                moves.emplace_back(p.src[k], p.lo + (uint32_t) k);
            }
            page_move_metadata(*p.kv, p.strm, moves);
            const uint32_t n_used = p.lo + (uint32_t) p.src.size();
            llama_page_kv_access::set_head(*p.kv, p.strm, n_used);
        }
        return LLAMA_PAGE_OK;
    } catch (const std::exception & e) {
        page_set_error(std::string("internal: ") + e.what() +
                       (moved ? "; the KV cache was partly compacted and must be cleared" : "; nothing was changed"));
        return LLAMA_PAGE_ERR_INTERNAL;
    }
}

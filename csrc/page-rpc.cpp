// page-rpc.cpp — page-local's record of lost RPC servers (page-rpc.h); a lost server is an error the
// caller can see, not an abort. Compiled into ggml-rpc (CMakeLists.txt).

#include "page-rpc.h"

#include "ggml-impl.h"

#include <cstdlib>
#include <mutex>
#include <unordered_set>

static std::mutex                      page_lost_mutex;
static std::unordered_set<std::string> page_lost;

void page_rpc_set_lost(const std::string & endpoint, bool lost) {
    if (lost && std::getenv("GGML_RPC_DEBUG")) {  // ggml-rpc.cpp's LOG_DBG
        GGML_LOG_DEBUG("[%s] RPC server %s crashed or returned malformed response\n", __func__, endpoint.c_str());
    }
    std::lock_guard<std::mutex> lock(page_lost_mutex);
    if (lost) {
        page_lost.insert(endpoint);
    } else {
        page_lost.erase(endpoint);
    }
}

int page_rpc_lost(const char * endpoint) {
    std::lock_guard<std::mutex> lock(page_lost_mutex);
    return page_lost.count(endpoint) ? 1 : 0;
}

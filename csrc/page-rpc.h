// page-rpc.h — page-local's record of lost RPC servers, for ggml's RPC client (ggml-rpc.cpp).
// csrc/patches/03-rpc.patch makes the client's dispatcher record a server that stopped answering here
// instead of aborting the process (RPC_STATUS_ASSERT), and hands page_rpc_lost to callers through
// ggml_backend_reg_get_proc_address(reg, "page_rpc_lost") (page_local/native/rpc.py). Compiled into
// ggml-rpc (CMakeLists.txt). docs/rpc.md.
#pragma once

#include <string>

// the dispatcher connected to `endpoint` saw its server fail (lost = true), or is being destroyed after
// that (lost = false: a new connection to the endpoint starts clean)
void page_rpc_set_lost(const std::string & endpoint, bool lost);

// 1 if the connection to `endpoint` failed (its models can only be freed), else 0
int page_rpc_lost(const char * endpoint);

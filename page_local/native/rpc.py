"""Remote devices: llama.cpp's RPC backend (docs/rpc.md).

Model(rpc=["HOST:PORT", ...]) adds the devices of ggml-rpc-server processes through ggml's backend
registry and hands them to that model only (llama_model_params.devices, never the process-wide device
list, so later local models stay local). Each server is checked with a HELLO of our own first (ggml's
client aborts the process on a server that is down); a server lost mid-run is an error of that model's
context (lost(), Context.decode), not an abort. The wire is unauthenticated: loopback or a trusted LAN.
"""

from __future__ import annotations

import ctypes
import os
import re
import socket
import struct
import sys
import time
from collections import Counter
from pathlib import Path

from page_local.errors import LibraryError, ModelError
from page_local.native import backend
from page_local.native import pageops as native

RPC_ENV = "PAGE_LOCAL_RPC"  # the default of rpc: HOST:PORT[,HOST:PORT...]
RPC_TIMEOUT_ENV = "PAGE_LOCAL_RPC_TIMEOUT"  # seconds a server may take to accept and answer HELLO
RPC_TIMEOUT = 5.0

_ENDPOINT = re.compile(r"(?P<host>[A-Za-z0-9.\-]+):(?P<port>\d{1,5})")
in_use: Counter = Counter()  # endpoint -> open Models holding a connection to it
_abort_cb = None  # the ctypes abort callback ggml holds a pointer to: kept alive for the process
_lost_fn = None  # page_rpc_lost, from the RPC backend's registry


def parse_rpc(value, source: str = "rpc") -> tuple[str, ...]:
    """'HOST:PORT[,HOST:PORT...]' or a list of them -> ('HOST:PORT', ...); None, '' or [] -> ().
    ValueError names the entry that is not HOST:PORT (a name or an IPv4 address, a port 1-65535)."""
    if value is None:
        return ()
    parts = value.split(",") if isinstance(value, str) else list(value)
    out = []
    for part in parts:
        text = part.strip() if isinstance(part, str) else part
        m = _ENDPOINT.fullmatch(text) if isinstance(text, str) else None
        if not m or not 1 <= int(m.group("port")) <= 65535:
            raise ValueError(f"{source}: {part!r} is not HOST:PORT (e.g. 192.168.1.20:50052)")
        if text in out:
            raise ValueError(f"{source}: {text} is given twice")
        out.append(text)
    return tuple(out)


def default_rpc() -> tuple[str, ...]:
    """$PAGE_LOCAL_RPC as parsed by parse_rpc (() when unset)."""
    return parse_rpc(os.environ.get(RPC_ENV, "").strip() or None, f"${RPC_ENV}")


def _rpc_timeout() -> float:
    text = os.environ.get(RPC_TIMEOUT_ENV, "").strip()
    try:
        value = float(text) if text else RPC_TIMEOUT
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"${RPC_TIMEOUT_ENV} must be a number of seconds > 0, got {text!r}")
    return value


# ggml-rpc's HELLO (ggml/src/ggml-rpc/ggml-rpc.cpp, protocol 7): command byte 14, u64 size, 24 bytes of
# transport capabilities (zeros: plain TCP); the answer is u64 size, then major, minor, patch, pad, caps
_RPC_HELLO, _RPC_CAPS, _RPC_MAJOR = 14, 24, 7


def check_rpc_server(endpoint: str, timeout: float | None = None) -> None:
    """Connect to a ggml-rpc-server and exchange HELLO as ggml's client does, within `timeout` seconds.
    llama.cpp's own client aborts the process when a server is down or is no RPC server; this check comes
    first so that those cases are one ModelError naming the address instead."""
    timeout = _rpc_timeout() if timeout is None else timeout
    host, port = endpoint.rsplit(":", 1)
    what = f"the RPC server at {endpoint}"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            s.sendall(struct.pack("<BQ", _RPC_HELLO, _RPC_CAPS) + bytes(_RPC_CAPS))
            answer = b""
            while len(answer) < 8 + 4 + _RPC_CAPS:
                chunk = s.recv(8 + 4 + _RPC_CAPS - len(answer))
                if not chunk:
                    raise ModelError(f"{what} closed the connection: is it a ggml-rpc-server of the same "
                                     "page-local build? (docs/rpc.md)")
                answer += chunk
    except socket.timeout:
        raise ModelError(f"{what} did not answer within {timeout:g} s (down, busy with another client, or "
                         f"not a ggml-rpc-server; ${RPC_TIMEOUT_ENV} sets the wait)") from None
    except OSError as e:
        raise ModelError(f"cannot reach {what}: {e.strerror or e} (is ggml-rpc-server running there? docs/rpc.md)") from None
    size, major, minor, patch = struct.unpack_from("<QBBB", answer)
    if size != 4 + _RPC_CAPS or major != _RPC_MAJOR:
        raise ModelError(f"{what} speaks RPC protocol {major}.{minor}.{patch}, this library "
                         f"{_RPC_MAJOR}.x: run the ggml-rpc-server of the same page-local build")


def _on_ggml_abort(message: bytes | None) -> None:
    """ggml's abort hook (the process ends right after it returns: ggml calls abort()). llama.cpp's RPC
    client aborts on a lost connection; say in one line which server is gone."""
    try:
        text = re.sub(r"\S*[/\\](ggml-rpc\.cpp:\d+)", r"\1", (message or b"").decode("utf-8", "replace").strip())
        if "ggml-rpc" in text and in_use:
            gone = [ep for ep in list(in_use) if not _listening(ep)]
            where = ("the RPC server at " + ", ".join(gone)) if gone else \
                ("an RPC server (one of " + ", ".join(in_use) + ")")
            sys.stderr.write(f"Error: lost {where} mid-run; llama.cpp's RPC client cannot recover from a "
                             f"lost server and ends the process (ggml: {text})\n")
            sys.stderr.flush()
        else:  # what ggml does without a hook: the message and a backtrace
            sys.stderr.write(f"{text}\n")
            sys.stderr.flush()
            backtrace = getattr(backend._lib, "ggml_print_backtrace", None)
            if backtrace is not None:
                backtrace()
    except Exception:  # noqa: BLE001  (nothing may cross back into C)
        pass


def _listening(endpoint: str) -> bool:
    """Whether a server still accepts connections (twice, 0.2 s apart: a killed one may accept once while
    the kernel tears it down). No HELLO: a live server busy with this process's connection would not answer."""
    host, port = endpoint.rsplit(":", 1)
    for attempt in range(2):
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
        except OSError:
            return False
        if attempt == 0:
            time.sleep(0.2)
    return True


def _install_abort_hook(lib) -> None:
    global _abort_cb
    if _abort_cb is None:
        _abort_cb = ctypes.CFUNCTYPE(None, ctypes.c_char_p)(_on_ggml_abort)
        lib.ggml_set_abort_callback(ctypes.cast(_abort_cb, ctypes.c_void_p))


def lost(endpoints) -> list[str]:
    """The endpoints among these whose connection failed mid-run. ggml's RPC client, as page-local
    patches it (csrc/patches/03-rpc.patch), stops sending once a server stops answering, reads zeros for its
    answers and fails every later graph, instead of aborting the process; this asks which."""
    query = _lost_query() if endpoints else None
    return [ep for ep in endpoints if query(ep.encode())] if query else []


def _lost_query():
    global _lost_fn
    if _lost_fn is None:
        cdll = backend.lib()
        reg = cdll.ggml_backend_reg_by_name(b"RPC")
        addr = cdll.ggml_backend_reg_get_proc_address(reg, b"page_rpc_lost") if reg else None
        if not addr:
            return None  # a library built before the patch had it
        _lost_fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p)(addr)
    return _lost_fn


def has_rpc() -> bool:
    """Whether the loaded library was built with ggml's RPC backend (PAGE_RPC=ON)."""
    return bool(backend.lib().ggml_backend_reg_by_name(b"RPC"))


def rpc_server_path() -> Path | None:
    """The ggml-rpc-server built with the loaded library (installed beside it), or None."""
    lib = native.llama_cpp().llama_cpp._lib
    exe = Path(lib._name).resolve().parent / ("ggml-rpc-server.exe" if sys.platform == "win32" else "ggml-rpc-server")
    return exe if exe.is_file() else None


def rpc_devices(endpoints) -> list[tuple[int, str]]:
    """(handle, 'RPCn HOST:PORT') of every device the servers offer, in order: each server is checked
    first (check_rpc_server) unless an open Model of this process is connected to it already."""
    lib = backend.lib()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise LibraryError("this build of page-local's library has no RPC backend: rebuild it with "
                           "`make setup RPC=1` (or CMAKE_ARGS=-DPAGE_RPC=ON pip install .)")
    addr = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
    if not addr:
        raise LibraryError("the RPC backend of this library has no ggml_backend_rpc_add_server")
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(addr)
    _install_abort_hook(lib)
    out = []
    for ep in endpoints:
        if not in_use[ep]:  # a connected server serves no second client: it would not answer
            check_rpc_server(ep)
        server = add_server(ep.encode())
        n = lib.ggml_backend_reg_dev_count(server) if server else 0
        if n == 0:
            raise ModelError(f"the RPC server at {ep} offers no device")
        for i in range(n):
            dev = lib.ggml_backend_reg_dev_get(server, i)
            out.append((dev, f"{(lib.ggml_backend_dev_name(dev) or b'RPC').decode()} {ep}"))
    return out

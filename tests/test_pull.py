"""`page-local pull` (page_local/store/pull.py, cli/pull.py) against a stand-in for the Hugging Face Hub on
127.0.0.1 ($HF_ENDPOINT points at it; the network is never used). The stand-in answers the routes
huggingface_hub calls: GET /api/models/ORG/REPO?blobs=True (the file list with sizes and LFS sha256) and
HEAD / GET /ORG/REPO/resolve/REV/FILE with the headers huggingface_hub reads (X-Repo-Commit, ETag,
Content-Length; X-Error-Code on errors) and range requests. It serves the real SmolLM2 file whole, and a
tiny llama split in two by gguf's writer (split.count in the header, as llama.cpp needs it to find part 2).

Each bad case has a test: a repo that does not exist, a quantization it lacks (the message lists those there
are), a gated repo without a token, the Hub stopped (network down), a disk that fills, a download cut off
(resumed), corrupted (sha256, removed), failed or stopped half-way: none leaves a file that `page-local
models` lists or a name resolves to."""

from __future__ import annotations

import errno
import hashlib
import json
import re
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from page_local.cli import main
from page_local.errors import ModelError, ModelInstallError
from page_local.store import discover, models, pull

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import one_line_error  # noqa: E402

COMMIT = "a" * 40
SMOL_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
SMOL_FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"
TINY_REPO = "tiny/Tiny-GGUF"
GATED_REPO = "meta/Gated-GGUF"
TOKEN = "hf_standin_token"


def split_gguf(src: Path, stem: Path, max_tensors: int) -> list[Path]:
    """`src` rewritten as a split model (gguf's writer: split.no / split.count / split.tensors.count in each
    part's header), parts `stem`-0000i-of-0000n.gguf."""
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(f"{stem}.gguf", r.fields["general.architecture"].contents(), split_max_tensors=max_tensors)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(f.name, f.contents(), f.types[0],
                        sub_type=f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(stem.parent.glob(f"{stem.name}-*-of-*.gguf"))


@pytest.fixture(scope="session")
def tiny_split(tmp_path_factory):
    from tiny_model import write_tiny_llama

    d = tmp_path_factory.mktemp("tiny")
    write_tiny_llama(d / "tiny.gguf")
    parts = split_gguf(d / "tiny.gguf", d / "Tiny-Q4_K_M", 20)
    assert len(parts) == 2
    return {p.name: p.read_bytes() for p in parts}


@pytest.fixture(scope="session")
def repos(smollm2_path, tiny_split):
    smol = smollm2_path.read_bytes()
    return {
        SMOL_REPO: {SMOL_FILE: smol, "SmolLM2-135M-Instruct-Q8_0.gguf": smol[:4096], "README.md": b"# SmolLM2\n",
                    "mmproj-SmolLM2-Q4_K_M.gguf": b"GGUF projector"},
        TINY_REPO: {**tiny_split, "Tiny-F32.gguf": b"GGUF not pulled"},
        GATED_REPO: {"Gated-Q4_K_M.gguf": smol},
    }


class Hub:
    """The stand-in: what it serves, what it was asked, and the faults a test asks of it."""

    def __init__(self, repos: dict):
        self.repos = repos
        self.log: list[tuple[str, str, str]] = []  # (method, path, Range header)
        self.cut_once: set[str] = set()  # files whose first GET stops half-way (the connection drops)
        self.fail: set[str] = set()  # files whose GET answers 500
        self.corrupt: set[str] = set()  # files served with one byte changed (the right size)
        self.connections: set = set()
        handler = type("Handler", (_Handler,), {"hub": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        """The network gone: no new connection is accepted, and the kept-alive ones are cut."""
        self.server.shutdown()
        self.server.server_close()
        for c in list(self.connections):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: Hub

    def log_message(self, *args):
        pass

    def setup(self):
        super().setup()
        self.hub.connections.add(self.connection)

    def finish(self):
        self.hub.connections.discard(self.connection)
        super().finish()

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, head: bool = False):
        self._send(status, json.dumps({"error": message}).encode(),
                   {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}, head)

    def _repo(self, org: str, name: str, head: bool = False) -> dict | None:
        files = self.hub.repos.get(f"{org}/{name}")
        if files is None:
            self._error(404, "RepoNotFound", "Repository not found", head)
        return files

    def do_GET(self):
        self._route(head=False)

    def do_HEAD(self):
        self._route(head=True)

    def _route(self, head: bool):
        path = self.path.split("?", 1)[0]
        self.hub.log.append((self.command, path, self.headers.get("Range", "")))
        m = re.fullmatch(r"/api/models/([^/]+)/([^/]+)(?:/revision/[^/]+)?", path)
        if m and not head:
            files = self._repo(*m.groups())
            if files is None:
                return
            siblings = [{"rfilename": f, "size": len(b), "blobId": hashlib.sha1(b).hexdigest(),
                         "lfs": {"sha256": hashlib.sha256(b).hexdigest(), "size": len(b), "pointerSize": 134}}
                        for f, b in files.items()]
            body = {"id": f"{m.group(1)}/{m.group(2)}", "sha": COMMIT, "siblings": siblings, "private": False,
                    "gated": "manual" if f"{m.group(1)}/{m.group(2)}" == GATED_REPO else False}
            return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
        m = re.fullmatch(r"/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)", path)
        if not m:
            return self._error(404, "", "no such route", head)
        files = self._repo(m.group(1), m.group(2), head)
        if files is None:
            return
        repo, name = f"{m.group(1)}/{m.group(2)}", m.group(4)
        if repo == GATED_REPO and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._error(401, "GatedRepo", "Access to this model is restricted", head)
        if name not in files:
            return self._error(404, "EntryNotFound", "Entry not found", head)
        data = files[name]
        meta = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream"}
        if head:
            return self._send(200, b"", {**meta, "Content-Length": str(len(data))}, head=True)
        if name in self.hub.fail:
            return self._error(500, "", "internal error")
        if name in self.hub.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        start = 0
        r = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if r:
            start = int(r.group(1))
            meta["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        self.send_response(206 if r else 200)
        for k, v in {**meta, "Content-Length": str(len(body))}.items():
            self.send_header(k, v)
        self.end_headers()
        if name in self.hub.cut_once:  # half the body, then the connection drops
            self.hub.cut_once.discard(name)
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(body)


@pytest.fixture
def hub(repos, tmp_path, monkeypatch):
    """The stand-in, $HF_ENDPOINT at it, an empty Hub cache in an empty home, no token."""
    h = Hub(repos)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("PAGE_LOCAL_HOME", str(tmp_path / "page-local"))
    for var in ("HF_TOKEN", "HF_HOME", "HUGGINGFACE_HUB_CACHE", "LLAMA_CACHE", "OLLAMA_MODELS", "PAGE_LOCAL_MODEL",
                "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(discover, "ollama_dirs", lambda: [home / ".ollama" / "models"])
    yield h
    h.stop()


def listed() -> list[str]:
    found, _ = discover.discover()
    return sorted(f.name for f in found)


def leftovers(tmp_path: Path) -> list[Path]:
    return sorted(p for p in (tmp_path / "hf").rglob("*") if p.is_file() and "incomplete" in p.name)


# --- choosing the file, as llama.cpp chooses it ------------------------------------------------

FILES = ["README.md", "Llama-3.2-1B-Instruct-Q8_0.gguf", "Llama-3.2-1B-Instruct-Q4_K_M.gguf",
         "Llama-3.2-1B-Instruct-Q4_K_M-GGUF/x.txt", "mmproj-Llama-Q4_K_M.gguf", "Big-Q6_K-00002-of-00002.gguf",
         "Big-Q6_K-00001-of-00002.gguf", "Llama-3.2-1B-Instruct-IQ4_XS.gguf"]


@pytest.mark.parametrize("quant, want", [
    (None, ["Llama-3.2-1B-Instruct-Q4_K_M.gguf"]), ("q8_0", ["Llama-3.2-1B-Instruct-Q8_0.gguf"]),
    ("Q6_K", ["Big-Q6_K-00001-of-00002.gguf", "Big-Q6_K-00002-of-00002.gguf"]),
    ("IQ4_XS", ["Llama-3.2-1B-Instruct-IQ4_XS.gguf"]), ("Q5_K_M", None),
], ids=["default-q4_k_m", "case-insensitive", "split-whole", "iq", "missing"])
def test_choose(quant, want):
    assert pull.choose(FILES, quant) == want
    assert pull.available_quants(FILES) == ["IQ4_XS", "Q4_K_M", "Q6_K", "Q8_0"]  # the projector is not a model


def test_choose_without_q4_k_m_takes_q8_0_then_the_first():
    assert pull.choose(["M-Q2_K.gguf", "M-Q8_0.gguf"], None) == ["M-Q8_0.gguf"]
    assert pull.choose(["M-Q2_K.gguf", "M-F16.gguf"], None) == ["M-Q2_K.gguf"]
    assert pull.choose(["README.md"], None) is None


@pytest.mark.parametrize("ref, want", [
    ("org/Repo-GGUF", ("org/Repo-GGUF", None)), ("org/Repo-GGUF:Q4_K_M", ("org/Repo-GGUF", "Q4_K_M")),
    ("hf.co/org/Repo-GGUF:q8_0", ("org/Repo-GGUF", "q8_0")),
    ("https://huggingface.co/org/Repo.v2-GGUF", ("org/Repo.v2-GGUF", None)),
], ids=["repo", "quant", "hf.co", "url"])
def test_parse_ref(ref, want):
    assert pull.parse_ref(ref) == want


@pytest.mark.parametrize("ref", ["llama3.2:3b", "org/", "org/repo/extra", "org/repo:Q4 K", "../x/y"])
def test_parse_ref_refuses(ref):
    with pytest.raises(ValueError, match="not a Hugging Face model name"):
        pull.parse_ref(ref)


# --- pulling from the stand-in -----------------------------------------------------------------

def test_pull_then_run_by_name(hub, smollm2_path, tmp_path):
    """The issue's 'done when': a named quantization fetched from the (stand-in) Hub, then used by name."""
    res = CliRunner().invoke(main, ["pull", f"hf.co/{SMOL_REPO}:q4_1"])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines() == [
        f"pulled {SMOL_REPO}:Q4_1 (98 MB) at {tmp_path / 'hf'}/models--HuggingFaceTB--SmolLM2-135M-Instruct-GGUF/"
        f"snapshots/{COMMIT}/{SMOL_FILE}", f"run it: page-local chat --model {SMOL_REPO}:Q4_1"]
    got = tmp_path / "hf" / "models--HuggingFaceTB--SmolLM2-135M-Instruct-GGUF"
    assert (got / "snapshots" / COMMIT / SMOL_FILE).read_bytes() == smollm2_path.read_bytes()
    assert (got / "refs" / "main").read_text() == COMMIT
    assert listed() == [f"{SMOL_REPO}:Q4_1"]
    # by name: the CLI, and a second pull that finds it there (no GET again)
    res = CliRunner().invoke(main, ["run", "--model", f"{SMOL_REPO}:Q4_1", "--prompt", "The capital of France is",
                                    "--max-tokens", "3", "--n-ctx", "256", "--threads", "1", "--gate", "never"])
    assert res.exit_code == 0 and res.stdout.strip(), res.output
    gets = sum(1 for m, p, _ in hub.log if m == "GET" and p.endswith(SMOL_FILE))
    res = CliRunner().invoke(main, ["pull", SMOL_REPO + ":Q4_1", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["downloaded"] is False
    assert sum(1 for m, p, _ in hub.log if m == "GET" and p.endswith(SMOL_FILE)) == gets
    # and with the Hub gone, the cached model is still found by pull and by name
    hub.stop()
    again = pull.pull(SMOL_REPO)
    assert again.downloaded is False and again.name == f"{SMOL_REPO}:Q4_1"


def test_pull_a_split_model_whole_and_llama_cpp_opens_it(hub, tiny_split):
    from page_local.native.runtime import Model

    seen = []
    got = pull.pull(TINY_REPO, lambda what, done, total: seen.append((what, done, total)))  # Q4_K_M by default
    assert got.name == f"{TINY_REPO}:Q4_K_M" and [p.name for p in got.parts] == sorted(tiny_split)
    assert got.size == sum(len(b) for b in tiny_split.values())
    assert seen[-1][1:] == (got.size, got.size) and all(d <= t for _, d, t in seen)
    assert listed() == [f"{TINY_REPO}:Q4_K_M"]
    with Model(models.resolve(f"hf.co/{TINY_REPO}:Q4_K_M")) as m:  # part 1 names part 2 (split.count)
        assert m.n_vocab == 300


def test_a_cut_connection_resumes_with_a_range_request(hub, smollm2_path):
    hub.cut_once.add(SMOL_FILE)
    got = pull.pull(f"{SMOL_REPO}:Q4_1")
    assert got.path.read_bytes() == smollm2_path.read_bytes()
    ranges = [r for m, p, r in hub.log if m == "GET" and p.endswith(SMOL_FILE)]
    assert ranges[0] == "" and re.fullmatch(r"bytes=\d+-", ranges[1]) and int(ranges[1][6:-1]) > 0


def test_a_repo_that_does_not_exist(hub):
    res = CliRunner().invoke(main, ["pull", "nobody/Nothing-GGUF"])
    one_line_error(res, 1, "no model repository nobody/Nothing-GGUF on http://127.0.0.1", "HF_TOKEN")


def test_a_quantization_the_repo_lacks_lists_those_it_has(hub):
    res = CliRunner().invoke(main, ["pull", f"{SMOL_REPO}:Q5_K_M"])
    one_line_error(res, 1, f"{SMOL_REPO} has no Q5_K_M file; it has Q4_1, Q8_0",
                   f"page-local pull {SMOL_REPO}:Q4_1")


def test_a_gated_repo_needs_a_token(hub, monkeypatch):
    res = CliRunner().invoke(main, ["pull", GATED_REPO])
    one_line_error(res, 1, f"{GATED_REPO} is gated", "set HF_TOKEN")
    assert listed() == []
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert pull.pull(GATED_REPO).name == f"{GATED_REPO}:Q4_K_M"


def test_the_hub_unreachable(hub):
    hub.stop()
    res = CliRunner().invoke(main, ["pull", f"{SMOL_REPO}:Q4_1"])
    one_line_error(res, 1, f"cannot reach {hub.url} to download {SMOL_REPO}", "check the network")


def test_a_malformed_name_is_a_usage_error(hub):
    one_line_error(CliRunner().invoke(main, ["pull", "llama3.2:3b"]), 2, "not a Hugging Face model name")


def test_a_full_disk(hub, monkeypatch, tmp_path):
    import huggingface_hub.file_download as fd

    def fills(url, temp_file, **kwargs):
        temp_file.write(b"GGUF" + b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fd, "http_get", fills)
    res = CliRunner().invoke(main, ["pull", f"{SMOL_REPO}:Q4_1"])
    one_line_error(res, 1, "the disk is full", str(tmp_path / "hf"))
    assert listed() == [] and leftovers(tmp_path) == []
    # known before it starts: a model larger than the free space is refused without a byte fetched
    monkeypatch.setattr(pull, "_free", lambda path: 1000)
    with pytest.raises(ModelInstallError, match=r"needs 98 MB, .* has 0 MB free"):
        pull.pull(f"{SMOL_REPO}:Q4_1")


def test_a_corrupted_download_is_removed(hub, tmp_path):
    hub.corrupt.add(SMOL_FILE)
    with pytest.raises(ModelInstallError, match="arrived with sha256 .* it was removed"):
        pull.pull(f"{SMOL_REPO}:Q4_1")
    assert listed() == [] and not list((tmp_path / "hf").rglob(SMOL_FILE))
    hub.corrupt.clear()
    assert pull.pull(f"{SMOL_REPO}:Q4_1").downloaded  # fetched again, whole


def test_half_a_split_is_never_a_model(hub, tmp_path):
    part2 = sorted(n for n in hub.repos[TINY_REPO] if "-00002-" in n)[0]
    hub.fail.add(part2)
    with pytest.raises(ModelInstallError, match="answered HTTP 500"):
        pull.pull(TINY_REPO)
    assert listed() == [] and leftovers(tmp_path) == []
    _, skipped = discover.discover()
    assert any("1 of its 2 parts" in s.reason for s in skipped)
    with pytest.raises(ModelError, match="no model named"):
        models.resolve(f"{TINY_REPO}:Q4_K_M")


def test_a_pull_stopped_half_way_leaves_nothing(hub, tmp_path):
    """Ctrl-C in the middle of a file: its temporary blob is removed, nothing is linked into a snapshot."""
    def stop(what, done, total):
        if 0 < done < total:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pull.pull(f"{SMOL_REPO}:Q4_1", stop)
    assert listed() == [] and leftovers(tmp_path) == []
    assert not list((tmp_path / "hf").rglob(SMOL_FILE))


# --- serve: what is on this machine, and Ollama's /api/pull --------------------------------------

def test_serve_lists_the_machine_and_pulls(hub, smollm2_path, tmp_path):
    """/v1/models and /api/tags list the served model first, then the others on this machine (not loaded);
    /api/pull fetches from the (stand-in) Hub with Ollama's status lines, or refuses with the reason."""
    import time

    from starlette.testclient import TestClient

    from page_local.serve import model_routes
    from page_local.serve.app import create_app
    from page_local.serve.backend import Backend, Settings

    model_routes.forget_others()
    backend = Backend(Settings(model_path=smollm2_path, served_name="smollm2", n_ctx=256, threads=1))
    with TestClient(create_app(backend)) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [m["name"] for m in c.get("/api/tags").json()["models"]] == ["smollm2:latest"]

        r = c.post("/api/pull", json={"model": f"hf.co/{SMOL_REPO}:Q4_1"})
        lines = [json.loads(x) for x in r.text.splitlines()]
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        statuses = [x.get("status") for x in lines]
        assert statuses[0] == "pulling manifest" and statuses[-1] == "success", lines
        assert f"pulling {SMOL_FILE}" in statuses and "verifying sha256 digest" in statuses
        last = next(x for x in reversed(lines) if x.get("status") == f"pulling {SMOL_FILE}")
        assert last["completed"] == last["total"] == smollm2_path.stat().st_size

        tags = c.get("/api/tags").json()["models"]
        assert [m["name"] for m in tags] == ["smollm2:latest", f"{SMOL_REPO}:Q4_1"]
        assert tags[1]["details"]["quantization_level"] == "Q4_1" and tags[1]["size"] == smollm2_path.stat().st_size
        cards = c.get("/v1/models").json()["data"]
        assert cards[0]["id"] == "smollm2" and "loaded" not in cards[0]["page_local"]
        assert cards[1]["id"] == f"{SMOL_REPO}:Q4_1" and cards[1]["page_local"]["loaded"] is False
        assert cards[1]["page_local"]["n_ctx_train"] == 8192

        r = c.post("/api/chat", json={"model": f"{SMOL_REPO}:Q4_1", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and "is on this machine but this server runs 'smollm2'" in r.json()["error"]
        assert f"page-local serve --model {SMOL_REPO}:Q4_1" in r.json()["error"]

        r = c.post("/api/pull", json={"model": "llama3.2:3b"})
        assert r.status_code == 400 and "does not download from Ollama's library" in r.json()["error"]
        r = c.post("/api/pull", json={"model": "nobody/Nothing-GGUF", "stream": False})
        assert r.status_code == 500 and "no model repository nobody/Nothing-GGUF" in r.json()["error"]
        r = c.post("/api/pull", json={"model": f"{SMOL_REPO}:Q5_K_M"})  # streamed: the error is the last line
        assert json.loads(r.text.splitlines()[-1])["error"].startswith(f"{SMOL_REPO} has no Q5_K_M file; it has Q4_1")

#!/usr/bin/env bash
# Apply csrc/patches/*.patch in order, with --fuzz 0, to a fresh extraction of the llama.cpp tree that
# csrc/UPSTREAM pins (or of SDIST, a llama-cpp-python sdist, when rebasing: docs/design.md, "How to rebase
# onto a newer llama.cpp"). Prints each patch's result and leaves the patched tree in OUT (a temporary folder
# by default) for a look at what failed: patch writes the rejected hunks beside their file (*.rej).
#
#   scripts/check-patches.sh [SDIST] [OUT]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
version=$(sed -n 's/^version=//p' "$repo/csrc/UPSTREAM")
sdist=${1:-${PAGE_CACHE_DIR:-$HOME/.cache/page-local}/llama_cpp_python-$version.tar.gz}
out=${2:-$(mktemp -d)}
[ -f "$sdist" ] || { echo "no sdist at $sdist (make setup downloads it; or pass one)" >&2; exit 2; }
name=$(basename "$sdist" .tar.gz)
mkdir -p "$out"
tar xzf "$sdist" -C "$out" "$name/vendor/llama.cpp"
tree="$out/$name/vendor/llama.cpp"
rc=0
for p in "$repo"/csrc/patches/*.patch; do
    if log=$(patch -p1 --forward --batch --fuzz 0 -d "$tree" -i "$p" 2>&1); then
        echo "ok      $(basename "$p")"
        grep -i "offset" <<<"$log" | sed 's/^/          /' || true
    else
        echo "FAILED  $(basename "$p")"
        sed 's/^/          /' <<<"$log"
        rc=1
    fi
done
echo "tree: $tree"
exit $rc

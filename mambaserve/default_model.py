"""The embedded default model: the demo NemotronH trained on Shakespeare that ships in the
package (see docs/demo_model.md)."""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent / "assets" / "demo_model"


def default_model_path() -> Path:
    if not (DEMO_MODEL_DIR / "config.json").exists():
        raise ValueError(f"the embedded demo model is missing from {DEMO_MODEL_DIR}; "
                         "pass --model PATH (a Hugging Face checkpoint folder)")
    return DEMO_MODEL_DIR

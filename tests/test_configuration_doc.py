"""docs/configuration.md is what the configuration classes say (regenerate it with
``.venv/bin/python scripts/configuration_doc.py > docs/configuration.md``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_configuration_page_is_generated_from_the_classes():
    spec = importlib.util.spec_from_file_location(
        "configuration_doc", ROOT / "scripts" / "configuration_doc.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = module.page()
    assert "| `RAGSNAP_DEFAULT_PRESS` | `--press` | `ragsnap-lookahead` |" in page
    assert "| `RAGSNAP_MAX_QUEUE` | `--max-queue` | `8` |" in page
    assert (ROOT / "docs" / "configuration.md").read_text() == page

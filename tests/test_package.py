"""The package surface: lazy top-level names, the LICENSE the metadata names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_ragsnap_does_no_work_and_exports_the_basic_snippet():
    code = (
        "import sys, ragsnap\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "from ragsnap import AnswerOptions, Document, RagSnapEngine, make_press\n"
        "assert RagSnapEngine.__module__ == 'ragsnap.engine.engine' and 'torch' in sys.modules\n"
        "press = make_press('snapkv', budget=64)\n"
        "print(type(AnswerOptions(press=press)).__name__, Document(id='a', text='t').id)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["AnswerOptions", "a"]


def test_unknown_names_and_dir():
    import ragsnap

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        ragsnap.Nope  # noqa: B018
    assert {"RagSnapEngine", "Document", "make_press"} <= set(dir(ragsnap))
    assert set(ragsnap.__all__) - {"__version__"} <= set(dir(ragsnap))


def test_license_is_the_apache_2_text_the_metadata_names():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()


def test_the_service_installs_under_ragsnaps_name():
    import tomllib

    wheel = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]
    assert wheel["targets"]["wheel"]["packages"] == ["ragsnap"]  # no top-level `api`
    assert (ROOT / "ragsnap" / "api").resolve() == (ROOT / "api").resolve()
    probe = "import sys, ragsnap.api.app, ragsnap.api.ray_app; print('api' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # nothing imports the folder under its bare name

"""``ragsnap bench storage`` on a tiny random model: bytes, loads and KL per stored dtype."""

from __future__ import annotations

import json

from ragsnap.cli import main


def test_bench_storage_compares_dtypes_against_the_models_own(tiny, capsys) -> None:
    argv = ["bench", "storage", "--context", "160", "--prompts", "2", "--budget", "48"]
    code = main([*argv, "--press", "snapkv", "--max-new-tokens", "6", "--dtypes", "bfloat16,int8"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)["storage"]
    assert list(report) == ["model", "bfloat16", "int8"]
    assert report["model"]["bytes_ratio"] == 1.0 and report["model"]["kl_added_by_storage"] == 0
    assert report["int8"]["entry_bytes"] < report["bfloat16"]["entry_bytes"]
    assert report["bfloat16"]["entry_bytes"] < report["model"]["entry_bytes"]
    for row in report.values():
        assert row["kl_to_full_mean"] >= 0 and row["hit_load_s_median"] > 0

"""``RAGSNAP_KV_MEMORY_GIB`` through the real app (issue 42): a request larger than the
whole KV memory is a 413 naming the limit; the others are answered; /metrics shows the
bound and what is held."""

from __future__ import annotations

import time

from tests.api_helpers import FAST
from tests.local_client import LocalClient
from tests.tiny_models import save_tiny_model


def test_a_request_over_the_whole_kv_memory_is_413_and_the_rest_answer(tmp_path):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings

    model = save_tiny_model(tmp_path / "model")
    per_token = 2 * 4 * 2 * 16 * 4  # the tiny model: K and V, 4 layers, 2 heads, 16 dims, fp32
    settings = Settings(
        model=model, device="cpu", cache_url="none", kv_memory_gib=300 * per_token / 2**30
    )
    small = {"question": "t5 t6", "documents": [{"text": "t7 t8 t9"}], "compression": FAST}
    big = {**small, "documents": [{"text": " ".join(f"t{2 + i % 90}" for i in range(400))}]}
    with LocalClient(create_app(settings)) as client:
        deadline = time.monotonic() + 120
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the tiny model never loaded"
            time.sleep(0.1)
        refused = client.post("/v1/answer", json={**big, "max_new_tokens": 4})
        answered = client.post("/v1/answer", json={**small, "max_new_tokens": 4})
        metrics = client.get("/metrics").text
    assert refused.status_code == 413, refused.text
    error = refused.json()["error"]
    assert error["code"] == "kv_memory" and "RAGSNAP_KV_MEMORY_GIB" in error["message"]
    assert answered.status_code == 200 and answered.json()["stats"]["new_tokens"] == 4
    assert f"ragsnap_kv_memory_bytes {float(int(300 * per_token))}" in metrics
    assert "ragsnap_kv_bytes_in_use 0.0" in metrics

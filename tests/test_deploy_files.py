"""``deploy/``: what can be checked without Docker or Kubernetes is checked here."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def load(name):
    return yaml.safe_load((DEPLOY / name).read_text())


def test_serve_config_is_valid_and_its_args_are_the_builders():
    config = load("serve.yaml")
    schema = pytest.importorskip("ray.serve.schema")
    validate = getattr(schema.ServeDeploySchema, "model_validate", None)
    (validate or schema.ServeDeploySchema.parse_obj)(config)
    app = config["applications"][0]
    assert app["import_path"] == "ragsnap.api.ray_app:build_app"
    from ragsnap.api.ray_app import RayAppArgs
    from ragsnap.api.settings import Settings

    args = RayAppArgs(**app["args"])
    assert set(args.settings) <= set(Settings.model_fields)
    # Ray's proxy and Redis must not both want 6379: Serve listens on its own port
    assert config["http_options"]["port"] != 6379


def test_kuberay_runs_the_serve_config_beside_redis():
    documents = list(yaml.safe_load_all((DEPLOY / "kuberay.yaml").read_text()))
    service = next(d for d in documents if d["kind"] == "RayService")
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert embedded["applications"] == load("serve.yaml")["applications"]
    redis = next(d for d in documents if d["kind"] == "Deployment")
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru" and "--maxmemory" in args
    names = {d["metadata"]["name"] for d in documents if d["kind"] == "Service"}
    url = embedded["applications"][0]["args"]["settings"]["cache_url"]
    assert re.match(r"redis://([^:/]+)", url).group(1) in names


def test_compose_runs_ragsnap_on_a_redis_cache_and_prometheus_scrapes_it():
    compose = load("compose.yaml")
    redis = compose["services"]["redis"]["command"]
    assert redis[redis.index("--maxmemory-policy") + 1] == "allkeys-lru" and "--maxmemory" in redis
    ragsnap = compose["services"]["ragsnap"]
    assert ragsnap["environment"]["RAGSNAP_CACHE_URL"].startswith("redis://redis:6379/")
    # the replicas share Redis, so they share its sealing key: compose refuses to start without it
    assert ragsnap["environment"]["RAGSNAP_CACHE_KEY"].startswith("${RAGSNAP_CACHE_KEY:?")
    assert (DEPLOY / ragsnap["build"]["dockerfile"].removeprefix("deploy/")).is_file()
    scrape = load("prometheus.yml")["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics"
    assert scrape["static_configs"][0]["targets"] == ["ragsnap:8000"]
    from ragsnap.api.routers import health

    assert "/metrics" in {route.path for route in health.router.routes}


def test_dockerfile_copies_what_exists_and_cuda_installs_flash_attn():
    text = (DEPLOY / "Dockerfile").read_text()
    for source in re.findall(r"^COPY (.+) \S+$", text, flags=re.MULTILINE):
        assert all((ROOT / part).exists() for part in source.split()), source
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(dep.startswith("flash-attn") for dep in extras["gpu"])
    cuda_branch = text.split('if [ "$CUDA" = "1" ]', 1)[1].split("else", 1)[0]
    assert '["gpu"]' in cuda_branch and "flash-attn" in cuda_branch and "ARG CUDA=0" in text
    assert any(dep.startswith("ray[serve]") for dep in extras["ray"])
    assert any("ray" in dep for dep in extras["dev"] if dep.startswith("ragsnap["))

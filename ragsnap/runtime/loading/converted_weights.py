"""Converted GGUF weights kept in the user cache, so only the first start dequantizes.

transformers turns a GGUF file into float32 weights and a tokenizer on every load (about
15 s for the embedded model on one CPU thread, 0.4 s from a saved folder). The first load
saves both as a Hugging Face folder (``config.json``, ``model.safetensors``, tokenizer
files) under ``$RAGSNAP_MODEL_CACHE`` (default: the user cache directory's ``models``),
named by a digest of the GGUF file's path, size and modification time and the
transformers version. A folder is complete once its ``ragsnap-converted.json`` exists
(written last, and the folder renamed into place), so an interrupted save is never read;
a folder that fails to load is removed and the GGUF loaded again. ``RAGSNAP_MODEL_CACHE=off``
turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MARKER = "ragsnap-converted.json"
FORMAT = 1  # bump when what is saved changes


def cache_root() -> Path | None:
    """Where converted folders live, or ``None`` when the cache is off."""
    configured = os.environ.get("RAGSNAP_MODEL_CACHE", "")
    if configured.lower() in ("off", "none", "0"):
        return None
    if configured:
        return Path(configured).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("ragsnap")) / "models"


def converted_folder(gguf: Path) -> Path | None:
    """The folder that holds (or will hold) ``gguf``'s converted weights."""
    root = cache_root()
    if root is None:
        return None
    import transformers

    stat = gguf.stat()
    identity = [
        str(gguf.resolve()),
        stat.st_size,
        stat.st_mtime_ns,
        transformers.__version__,
        FORMAT,
    ]
    digest = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:24]
    return root / f"{gguf.stem}-{digest}"


def is_complete(folder: Path | None) -> bool:
    return folder is not None and (folder / MARKER).is_file()


def discard(folder: Path) -> None:
    """Remove a folder that failed to load; the next start converts again."""
    logger.warning("converted weights in %s failed to load; converting the GGUF again", folder)
    shutil.rmtree(folder, ignore_errors=True)


def save_converted(model: Any, tokenizer: Any, gguf: Path, folder: Path) -> bool:
    """Save ``model`` (weights as loaded, before any layout change) and ``tokenizer``.

    Returns whether the folder is now in place. Never raises: a read-only or full cache
    directory only costs the next start its conversion.
    """
    try:
        folder.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
        try:
            # a GGUF-loaded model refuses save_pretrained; its config and weights save plainly
            from safetensors.torch import save_model

            model.config.to_json_file(staging / "config.json")
            save_model(model, str(staging / "model.safetensors"))  # one copy of tied weights
            tokenizer.save_pretrained(staging)
            (staging / MARKER).write_text(json.dumps({"source": gguf.name, "format": FORMAT}))
            os.rename(staging, folder)  # atomic; fails if another process got there first
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        if is_complete(folder):
            return True
        logger.warning("could not keep converted weights in %s: %s", folder, exc)
        return False
    logger.info("kept converted weights of %s in %s", gguf.name, folder)
    return True

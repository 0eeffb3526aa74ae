"""The embedded default store: one file per entry in a directory, with a size cap.

Layout: ``ROOT/<namespace>/<kind>-<digest>.kv``; each file is a magic line, the sha256 of
the payload and the payload. A cached KV is as sensitive as its documents, so the folders
the store creates are 0700 and its files 0600 whatever the umask; a folder that already
exists keeps its mode (a warning when others may read it). The store only ever deletes
what it wrote: a file is an entry when its name is ``<kind>-<64 hex>.kv`` and it starts
with the magic line; anything else in the folders is left alone. Writes go to a temporary
file and are renamed into place, so a reader sees a whole entry or none; reading touches the file's mtime, and the oldest
files go first when the directory grows past ``max_bytes``. The directory's size is a tally
kept beside the lock files (``.locks/usage``): a put adds its bytes to it and scans the
directory only when the tally would pass ``max_bytes`` or is older than ``RESCAN_S``, so a
put costs the same in a store of ten entries or ten thousand (a cold prompt writes one
entry per document). Eviction and per-entry
computation hold :mod:`filelock` locks, so two processes can share one directory. A full
disk (ENOSPC) evicts the oldest entries to make room and tries once more; if that fails
too, the entry is not stored and the answer goes on.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from ragsnap.cache.backends.store import EntryKey, KVStore, namespace_label

logger = logging.getLogger(__name__)

MAGIC = b"RAGSNAP-KV-FILE-1\n"
DIGEST_BYTES = 32
DEFAULT_MAX_BYTES = 4 * 2**30
SUFFIX = ".kv"
_STALE_TMP_S = 3600.0  # a temporary file this old belongs to a writer that died
# the size tally is trusted this long after the scan it started from: files that appear
# without a put (another program's) are counted at the next scan at most this late
RESCAN_S = 60.0
USAGE_FILE = "usage"  # in the lock folder: "<bytes> <unix time of the last scan>"
# entry locks are striped so lock files never pile up: the digest's first byte, so taking
# keys in digest order (KVStore.exclusive_many) takes their stripes in order too
_LOCK_STRIPES = 256
DIR_MODE = 0o700
FILE_MODE = 0o600
KEY_FILE = ".ragsnap-key"  # the sealing key made for this store when none is configured
_ENTRY_NAME = re.compile(r"^[a-z]+-[0-9a-f]{64}\.kv$")
# our own temporary files: .<entry name>.<pid>.<monotonic ns>.tmp
_TMP_NAME = re.compile(r"^\.[a-z]+-[0-9a-f]{64}\.kv\.\d+\.\d+\.tmp$")


def is_entry(path: Path) -> bool:
    """Whether ``path`` is an entry this store wrote: its name, then its magic line."""
    if not _ENTRY_NAME.match(path.name):
        return False
    try:
        with open(path, "rb") as handle:
            return handle.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def make_private_dirs(path: Path) -> bool:
    """Create ``path`` and its missing parents with mode 0700 (chmod after mkdir: the umask
    filters mkdir's mode). Existing folders are left as they are. True when ``path`` existed."""
    missing: list[Path] = []
    current = path
    while not current.is_dir():
        missing.append(current)
        current = current.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=DIR_MODE)
        except FileExistsError:
            continue  # made by another process meanwhile: theirs, as they made it
        os.chmod(folder, DIR_MODE)
    return not missing


class FileKVStore(KVStore):
    """Entries as files under ``root``, ``max_bytes`` at most (least recently used go first)."""

    scheme = "file"

    def __init__(self, root: str | Path, max_bytes: int | None = None) -> None:
        super().__init__()
        self.root = Path(root)
        self.max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else int(max_bytes)
        self._locks = self.root / ".locks"
        self._private: set[Path] = set()
        # one lock object per stripe: a thread holding two keys of one stripe re-enters it
        # (filelock counts per thread), other threads and processes wait for it
        self._stripes: dict[int, FileLock] = {}
        self._stripes_guard = threading.Lock()

    def describe(self) -> str:
        return f"file://{self.root}"

    # -- paths and locks --------------------------------------------------------------

    def _path(self, key: EntryKey) -> Path:
        return self.root / key.label / f"{key.kind}-{key.digest}{SUFFIX}"

    def _ensure_dirs(self, *dirs: Path) -> None:
        """Create whatever is missing of ``root``, its lock folder and ``dirs`` (0700)."""
        for d in (self.root, self._locks, *dirs):
            if d in self._private and d.is_dir():
                continue
            existed = make_private_dirs(d)
            if existed and d == self.root:
                mode = stat.S_IMODE(d.stat().st_mode)
                if mode & 0o077:
                    logger.warning(
                        "file cache: %s is readable by others (mode %o); cached KV is as "
                        "sensitive as its documents: use a private folder",
                        d,
                        mode,
                    )
            self._private.add(d)

    def sealing_key(self) -> bytes:
        """This store's own sealing key, made on first use: 32 random bytes in
        ``ROOT/.ragsnap-key``, readable by its owner only. Every process that opens the
        folder shares it; an entry written under another key is a miss."""
        self._ensure_dirs()
        path = self.root / KEY_FILE
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        except FileExistsError:
            for _ in range(50):  # another process may be writing it right now
                text = path.read_text(encoding="ascii").strip()
                if text:
                    if stat.S_IMODE(path.stat().st_mode) & 0o077:
                        logger.warning("file cache: %s is readable by others", path)
                    try:
                        return bytes.fromhex(text)
                    except ValueError:
                        raise OSError(f"{path} does not hold a hex key") from None
                time.sleep(0.01)
            raise OSError(f"the cache key file {path} is empty") from None
        key = secrets.token_bytes(32)
        with os.fdopen(fd, "w", encoding="ascii") as handle:
            handle.write(key.hex() + "\n")
        return key

    def _lock(self, name: str) -> FileLock:
        return FileLock(str(self._locks / name), mode=FILE_MODE)

    def _eviction_lock(self) -> FileLock:
        self._ensure_dirs()
        return self._lock("evict.lock")

    @contextmanager
    def exclusive(self, key: EntryKey, wait_s: float = 300.0) -> Iterator[None]:
        with self._local_lock(key, wait_s):
            stripe = int(key.digest[:2], 16) % _LOCK_STRIPES
            lock: FileLock | None = None
            try:
                self._ensure_dirs()
                with self._stripes_guard:
                    lock = self._stripes.get(stripe)
                    if lock is None:
                        lock = self._stripes[stripe] = self._lock(f"entry-{stripe:03d}.lock")
                lock.acquire(timeout=wait_s)
            except (Timeout, OSError) as exc:
                logger.warning("file cache: no entry lock (%s); computing without it", exc)
                lock = None
            try:
                yield
            finally:
                if lock is not None:
                    lock.release()

    # -- entries ----------------------------------------------------------------------

    def get(self, key: EntryKey) -> bytes | None:
        path = self._path(key)
        head = len(MAGIC) + DIGEST_BYTES
        try:
            with open(path, "rb") as handle:
                header = handle.read(head)
                payload = handle.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("file cache: cannot read %s: %s", path.name, exc)
            return None
        if (
            len(header) < head
            or header[: len(MAGIC)] != MAGIC
            or hashlib.sha256(payload).digest() != header[len(MAGIC) :]
        ):
            self.reject(key, "checksum")
            return None
        try:
            os.utime(path)  # least recently used goes first
        except OSError:
            pass
        return payload

    def put(self, key: EntryKey, payload: bytes) -> bool:
        path = self._path(key)
        size = len(MAGIC) + DIGEST_BYTES + len(payload)
        if size > self.max_bytes:
            logger.warning(
                "file cache: entry of %d bytes exceeds the cap of %d; not stored",
                size,
                self.max_bytes,
            )
            return False
        try:
            self._ensure_dirs(path.parent)
            self._write(path, payload)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or not self._make_room(size, keep=path):
                logger.warning("file cache: cannot write %s: %s", path.name, exc)
                return False
            try:  # room was made: one more try, then the answer goes on without the cache
                self._write(path, payload)
            except OSError as again:
                logger.warning("file cache: cannot write %s: %s", path.name, again)
                return False
        self._count(size, keep=path)
        return True

    def _count(self, size: int, keep: Path) -> None:
        """Add a written entry's ``size`` to the directory's tally; scan and evict when the
        tally would pass ``max_bytes``, or is missing or stale (:data:`RESCAN_S`)."""
        try:
            with self._eviction_lock():
                usage = self._locks / USAGE_FILE
                try:
                    total_text, scanned_text = usage.read_text(encoding="ascii").split()
                    total, scanned = int(total_text) + size, float(scanned_text)
                except (OSError, ValueError):
                    total, scanned = None, 0.0
                if total is None or total > self.max_bytes or time.time() - scanned > RESCAN_S:
                    total, scanned = self._evict(keep), time.time()
                tmp = usage.with_name(f".{USAGE_FILE}.{os.getpid()}.tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
                with os.fdopen(fd, "w", encoding="ascii") as handle:
                    handle.write(f"{total} {scanned}\n")
                os.replace(tmp, usage)
        except OSError as exc:
            logger.warning("file cache: eviction failed: %s", exc)

    def _write(self, path: Path, payload: bytes) -> None:
        """Write the entry to a private temporary file and rename it into place."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            with os.fdopen(fd, "wb") as handle:
                handle.write(MAGIC)
                handle.write(hashlib.sha256(payload).digest())
                handle.write(payload)
            os.replace(tmp, path)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            raise

    def _make_room(self, needed: int, keep: Path) -> bool:
        """After ENOSPC: delete least recently used entries (other than ``keep``) until
        ``needed`` bytes are freed. False when there was nothing to free."""
        freed = 0
        try:
            with self._eviction_lock():
                entries = sorted(
                    (st.st_mtime, st.st_size, path)
                    for path, st in self._entries()
                    if path != keep and _ENTRY_NAME.match(path.name)
                )
                for _, size, path in entries:
                    if freed >= needed:
                        break
                    if not is_entry(path):
                        continue
                    path.unlink(missing_ok=True)
                    freed += size
        except OSError as exc:
            logger.warning("file cache: cannot make room after a full disk: %s", exc)
        if freed:
            logger.warning("file cache: disk full; evicted %d bytes to make room", freed)
        return freed > 0

    def delete(self, key: EntryKey) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("file cache: cannot delete %s: %s", key.digest, exc)

    def _entries(self, namespace: str | None = None) -> Iterator[tuple[Path, os.stat_result]]:
        dirs = (
            [self.root / namespace_label(namespace)]
            if namespace is not None
            else (
                [d for d in self.root.iterdir() if d.is_dir() and not d.name.startswith(".")]
                if self.root.is_dir()
                else []
            )
        )
        for d in dirs:
            if not d.is_dir():
                continue
            for path in d.iterdir():
                try:
                    yield path, path.stat()
                except FileNotFoundError:  # removed by another process meanwhile
                    continue

    def _evict(self, keep: Path) -> int:
        """Delete least recently used entries until the directory fits ``max_bytes`` (the
        eviction lock held); the bytes its entries hold after."""
        now = time.time()
        entries = []
        for path, st in self._entries():
            if _TMP_NAME.match(path.name):
                if now - st.st_mtime > _STALE_TMP_S:
                    path.unlink(missing_ok=True)
                continue
            if _ENTRY_NAME.match(path.name):  # the magic line is read before a delete
                entries.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            if path == keep or not is_entry(path):
                continue
            path.unlink(missing_ok=True)
            total -= size
            logger.info("file cache: evicted %s (%d bytes)", path.name, size)
        return total

    def clear(self, namespace: str | None = None) -> int:
        """Delete the entries (of ``namespace``); other files stay. Folders left empty go."""
        removed = 0
        folders = set()
        for path, _ in list(self._entries(namespace)):
            if is_entry(path):
                path.unlink(missing_ok=True)
                removed += 1
                folders.add(path.parent)
        for folder in folders:
            try:
                folder.rmdir()  # only when nothing else is in it
            except OSError:
                pass
        return removed

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        sizes = [st.st_size for path, st in self._entries(namespace) if is_entry(path)]
        return {
            "backend": "file",
            "url": self.describe(),
            "state": "ok",
            "entries": len(sizes),
            "bytes": sum(sizes),
            "max_bytes": self.max_bytes,
        }

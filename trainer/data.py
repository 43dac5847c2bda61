"""Byte-level corpus from the running interpreter's standard library, and a resumable sampler.

The corpus is every ``*.py`` file under ``sysconfig.get_paths()['stdlib']`` (site-packages
excluded), in sorted path order. A file goes to validation when ``crc32(relative path) % 50 == 0``
(about 2 %), so the split is deterministic and never cuts a file. Both splits are cached as raw
``uint8`` files, read back as numpy memmaps; the cache name carries a fingerprint of the file list
so a different interpreter builds its own.

Samples are non-overlapping windows of ``context + 1`` bytes. The sampler walks one permutation
per epoch with a global cursor; each step takes the next ``global batch`` samples and dp rank r
takes its contiguous slice, so changing the per-rank split never skips or repeats a sample.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ENV_CACHE = "TRAINGUARD_CACHE"


def cache_root(configured: str = "") -> Path:
    if configured:
        return Path(configured)
    env = os.environ.get(ENV_CACHE)
    return Path(env) if env else Path.home() / ".cache" / "trainguard"


@functools.cache
def stdlib_files() -> tuple[Path, ...]:
    """The corpus's source files. Walking the stdlib takes ~0.45 s here, which every restarted rank
    paid before its first step: kept per process, and walked once in the warm launcher before it
    forks (``trainguard.trainer.zygote``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


@functools.cache
def stdlib_digest() -> str:
    """A digest of the corpus's file list (part of the cache key: a changed stdlib, a new corpus)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    fp = hashlib.sha256()
    for f in stdlib_files():
        fp.update(f.relative_to(root).as_posix().encode())
    return fp.hexdigest()


def _is_val(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % 50 == 0


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def build_corpus(cache_dir: str = "", max_bytes: int = 0) -> tuple[Path, Path]:
    """Paths of the cached (train, val) byte files, building them on first use.

    Concurrent builders (several ranks) are safe: each writes its own temporary file and renames.
    ``max_bytes`` caps the train and validation split together, taking files in order.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    key = hashlib.sha256(f"{sys.version}|{root}|{max_bytes}|{stdlib_digest()}".encode()).hexdigest()[:16]
    out = cache_root(cache_dir)
    train_path, val_path = out / f"stdlib-{key}.train.u8", out / f"stdlib-{key}.val.u8"
    if train_path.exists() and val_path.exists():
        return train_path, val_path
    out.mkdir(parents=True, exist_ok=True)
    train, val, total = bytearray(), bytearray(), 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        rel = f.relative_to(root).as_posix()
        (val if _is_val(rel) else train).extend(data)
        total += len(data)
        if max_bytes and total >= max_bytes:
            break
    if total == 0:
        # An empty corpus would fail later as "cannot mmap an empty file", naming neither cause.
        raise RuntimeError(f"no corpus: the standard library's sources under {root} could not be read by "
                           f"uid {os.geteuid()} (build the cache in {out} as a user who can)")
    _write_atomic(val_path, bytes(val))
    _write_atomic(train_path, bytes(train))
    return train_path, val_path


@dataclass
class Corpus:
    train: np.ndarray
    val: np.ndarray

    @classmethod
    def load(cls, cache_dir: str = "", max_bytes: int = 0) -> Corpus:
        train_path, val_path = build_corpus(cache_dir, max_bytes)
        return cls(np.memmap(train_path, dtype=np.uint8, mode="r"), np.memmap(val_path, dtype=np.uint8, mode="r"))


def windows(tokens: np.ndarray, context: int, index: np.ndarray) -> np.ndarray:
    """Samples ``index`` (non-overlapping windows of context + 1 bytes) as an int64 array (n, context+1)."""
    span = context + 1
    out = np.empty((len(index), span), dtype=np.int64)
    for row, i in enumerate(index):
        out[row] = tokens[int(i) * span:(int(i) + 1) * span]
    return out


def split_counts(total: int, parts: int) -> list[int]:
    """Even split of ``total`` into ``parts`` counts, the first ones one larger."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class Sampler:
    """Global cursor over per-epoch permutations of the train windows.

    ``next_step(sizes)`` returns the sample indices of one optimizer step for every dp rank
    (``sizes[r]`` samples for rank r, contiguous slices in rank order) and advances the cursor.
    Its state (``epoch``, ``cursor``) is all a checkpoint needs to resume the exact sequence.
    """

    def __init__(self, n_samples: int, seed: int) -> None:
        if n_samples <= 0:
            raise ValueError("corpus too small for one sample")
        self.n = n_samples
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._perm = self._permutation(self.epoch)

    def take(self, count: int) -> np.ndarray:
        parts = []
        while count > 0:
            if self.cursor >= self.n:
                self.epoch += 1
                self.cursor = 0
                self._perm = self._permutation(self.epoch)
            n = min(count, self.n - self.cursor)
            parts.append(self._perm[self.cursor:self.cursor + n])
            self.cursor += n
            count -= n
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def next_step(self, sizes: list[int]) -> list[np.ndarray]:
        flat = self.take(sum(sizes))
        bounds = np.cumsum([0, *sizes])
        return [flat[bounds[r]:bounds[r + 1]] for r in range(len(sizes))]


def val_index(n_val_windows: int, count: int) -> np.ndarray:
    """The fixed validation set: the first ``count`` windows spread evenly over the val split."""
    if n_val_windows <= 0:
        raise ValueError("validation split too small for one sample")
    count = min(count, n_val_windows)
    return np.linspace(0, n_val_windows - 1, count).astype(np.int64)

"""Checksums of a checkpoint's files: recorded when they are written, verified before a load.

DCP stores no checksum: a flipped bit in a shard loads silently (a wrong optimiser moment, say), a
truncated or missing file fails deep in the storage layer without naming it. So every file a save
writes gets a CRC-32 and a size, and the coordinator lists them all in ``checksums.json``:

* DCP's shard files and ``.metadata``: computed while DCP writes them (``ChecksumWriter``, a
  ``FileSystemWriter`` whose streams update a CRC as the bytes pass), so saving reads nothing back;
  each rank knows the files it wrote, and the coordinator gathers the lists.
* ``vescale.pt``: computed from the bytes written.

``verify(folder, rank, world)`` checks this rank's share of the files: file ``i`` of the sorted list
belongs to rank ``i % world``, so each file is read once, by one rank, in 8 MiB pieces (zlib's CRC-32
releases the GIL: a few GB/s). The caller gathers every rank's findings, so all ranks reach the same
verdict on the same checkpoint (``vescale.checkpoint.api.load``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
import zlib
from pathlib import Path
from typing import Any, Iterator

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

__all__ = ["MANIFEST", "CheckpointCorruptError", "ChecksumWriter", "crc32_of_file", "write_manifest", "verify"]

MANIFEST = "checksums.json"
_FORMAT = 1
_CHUNK = 8 << 20


class CheckpointCorruptError(RuntimeError):
    """A checkpoint's files do not match the checksums recorded when it was saved (or cannot be read)."""


class _Summing(io.RawIOBase):
    """A write stream that passes bytes through to ``raw`` and keeps their CRC-32 and count."""

    def __init__(self, raw):
        self.raw, self.crc, self.size = raw, 0, 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return self.raw.write(view)

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()


class _SummingFileSystem(FileSystem):
    """DCP's local file system, with a CRC-32 of every file it writes (keyed by final file name)."""

    def __init__(self):
        super().__init__()
        self.sums: dict[str, dict] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as stream:
            summing = _Summing(stream)
            yield summing
        with self._lock:
            self.sums[Path(path).name] = {"crc32": summing.crc, "bytes": summing.size}

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP writes .metadata as a temp file, then renames it
        with self._lock:
            if Path(path).name in self.sums:
                self.sums[Path(new_path).name] = self.sums.pop(Path(path).name)


class ChecksumWriter(FileSystemWriter):
    """``FileSystemWriter`` that records the CRC-32 and size of each file it writes in ``sums``."""

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        self.fs = _SummingFileSystem()

    @property
    def sums(self) -> dict[str, dict]:
        return dict(self.fs.sums)


def crc32_of_bytes(data: bytes) -> dict:
    return {"crc32": zlib.crc32(data), "bytes": len(data)}


def crc32_of_file(path: Path) -> dict:
    """CRC-32 and size of a file, read in ``_CHUNK`` pieces."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"crc32": crc, "bytes": size}


def write_manifest(folder: Path, sums: dict[str, dict]) -> None:
    """The coordinator's list of every file of the checkpoint in ``folder`` with its checksum."""
    body = {"format": _FORMAT, "algorithm": "crc32", "files": dict(sorted(sums.items()))}
    path = folder / MANIFEST
    with open(path, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(folder: Path) -> dict[str, dict] | None:
    """The recorded checksums of ``folder``'s files; None for a checkpoint saved before checksums
    were recorded. Raises ``CheckpointCorruptError`` for a manifest that cannot be read."""
    path = folder / MANIFEST
    if not path.exists():
        return None
    try:
        body = json.loads(path.read_text())
        files = body["files"]
        if body.get("algorithm") != "crc32" or not isinstance(files, dict):
            raise ValueError("unknown layout")
        return files
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointCorruptError(f"{path}: the checksum list cannot be read ({type(e).__name__}: {e})") from None


def verify(folder: Path, files: dict[str, dict], rank: int = 0, world: int = 1) -> list[str]:
    """Check this rank's share of ``files`` (file i of the sorted names when ``i % world == rank``)
    against their recorded size and CRC-32; one line per problem, naming the file."""
    problems = []
    for i, name in enumerate(sorted(files)):
        if i % world != rank:
            continue
        path, want = folder / name, files[name]
        try:
            got = crc32_of_file(path)
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
        except OSError as e:
            problems.append(f"{path}: cannot be read ({e})")
            continue
        if got["bytes"] != want["bytes"]:
            problems.append(f"{path}: {got['bytes']} bytes, {want['bytes']} when saved (truncated or overwritten)")
        elif got["crc32"] != want["crc32"]:
            problems.append(f"{path}: CRC-32 {got['crc32']:08x}, {want['crc32']:08x} when saved (its bytes changed)")
    return problems

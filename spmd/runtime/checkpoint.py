"""Checkpoints as Hugging Face writes them (safetensors), read and written without any rank holding the
whole model.

    load_safetensors   each rank reads only its slices of each tensor, with plain reads (`read_piece`),
                       from one file, or from the shards an index names (`model.safetensors.index.json`:
                       {"weight_map": {name: file}}), as transformers' `save_pretrained` writes them
    save_safetensors   the full tensors, gathered one at a time and written by rank 0 as they arrive: the
                       header (names, dtypes, shapes, offsets) is known from the plan before any data moves

The safetensors format: 8 bytes little-endian header length, a JSON header {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}} padded with spaces to a multiple of 8, then the
tensors' bytes back to back.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

from spmd.core.errors import SpmdError, SpmdInternalError

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
          torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}
DTYPE_OF = {name: dtype for dtype, name in DTYPES.items()}
INDEX = "model.safetensors.index.json"


def checkpoint_files(path) -> dict[str, Path]:
    """tensor name -> the file holding it: `path` is a .safetensors file, an index JSON, or a folder with
    either `model.safetensors` or the index (or peft's `adapter_model.safetensors`, the folder its
    `save_pretrained` wrote)."""
    path = Path(path)
    if path.is_dir():
        found = [path / name for name in (INDEX, "model.safetensors", "adapter_model.safetensors")
                 if (path / name).exists()]
        path = found[0] if found else path / "model.safetensors"
    if not path.exists():
        raise SpmdError(f"no checkpoint at {path}. What to do: pass a .safetensors file, an index "
                        f"({INDEX}) or the folder save_pretrained wrote (on several machines, on every one of them: "
                        "save_safetensors writes on the mesh's first rank alone, on its machine's own disk unless the "
                        "path is on a shared filesystem).")
    if path.suffix == ".json":
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SpmdError(f"{path}: not a safetensors index (a JSON object with a \"weight_map\"): {e}") from None
        files = {name: path.parent / file for name, file in weight_map.items()}
        gone = sorted({str(f.name) for f in files.values() if not f.exists()})
        if gone:
            raise SpmdError(f"{path} names shard files that are not there: {', '.join(gone)}. What to do: copy the "
                            "whole checkpoint folder.")
        return files
    _, header = read_header(path)
    return {name: path for name in header if name != "__metadata__"}


def read_header(path) -> tuple[int, dict]:
    """(where the data starts, the JSON header) of a safetensors file."""
    with open(path, "rb") as f:
        head = f.read(8)
        try:
            n = struct.unpack("<Q", head)[0]
            return 8 + n, json.loads(f.read(n))
        except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SpmdError(f"{path}: not a safetensors file, or its header is cut short ({e}). What to do: check "
                            "the file is complete (its size, a checksum from where it came from).") from None


def _readinto(f, offset: int, out: torch.Tensor) -> None:
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    f.seek(offset)
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise SpmdError(f"{f.name}: the file ends before byte {offset + len(view)} (a truncated checkpoint)")
        got += n


def read_piece(f, data_start: int, entry: dict, index: tuple[slice, ...], block_bytes: int = 16 << 20) -> torch.Tensor:
    """The `index` part of one tensor with plain reads: only the rows in range, in blocks of at most
    `block_bytes` when the piece is a range of columns (in one read when it is whole rows). No file
    pages are mapped: `safe_open(...).get_slice` maps the file, and a column range touches (and RSS
    counts) every page of the tensor."""
    dtype = DTYPE_OF[entry["dtype"]]
    shape = tuple(entry["shape"])
    begin = data_start + entry["data_offsets"][0]
    out = torch.empty(tuple(s.stop - s.start for s in index), dtype=dtype)
    if out.numel() == 0:
        return out
    if not shape:
        _readinto(f, begin, out)
        return out
    row_bytes = math.prod(shape[1:]) * out.element_size()
    a, b = index[0].start, index[0].stop
    if all(s.start == 0 and s.stop == n for s, n in zip(index[1:], shape[1:])):
        _readinto(f, begin + a * row_bytes, out)
        return out
    k = max(1, block_bytes // max(row_bytes, 1))
    buf = torch.empty((min(k, b - a),) + shape[1:], dtype=dtype)
    for r in range(a, b, k):
        n = min(k, b - r)
        _readinto(f, begin + r * row_bytes, buf[:n])
        out[r - a:r - a + n] = buf[:n][(slice(None),) + index[1:]]
    return out


def read_pieces(files: dict[str, Path], wanted: dict[str, tuple[tuple[slice, ...], tuple[int, ...]]]):
    """(name, its piece) for each of `wanted` {name: (index, the model's shape for it)}, one at a time (the
    caller copies each where it goes before the next is read: a rank never holds more than one piece beside
    its shards), each file opened once."""
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        data_start, header = read_header(path)
        with open(path, "rb", buffering=0) as f:
            for name in names:
                index, shape = wanted[name]
                if name not in header:
                    raise SpmdError(f"{path.name} does not hold {name!r}, though the checkpoint's index says so. "
                                    "What to do: check the index (model.safetensors.index.json) against its shard "
                                    "files.")
                if tuple(header[name]["shape"]) != tuple(shape):
                    raise SpmdError(f"{path.name}: {name!r} has shape {tuple(header[name]['shape'])}, the model's "
                                    f"is {tuple(shape)}. What to do: load a checkpoint of this model's configuration.")
                yield name, read_piece(f, data_start, header[name], index)


def headers_digest(files: dict[str, Path]) -> bytes:
    """The headers and sizes of a checkpoint's files (what every rank should be reading)."""
    import hashlib

    h = hashlib.sha1()
    for path in sorted(set(files.values())):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}:".encode())
        data_start, header = read_header(path)
        h.update(json.dumps(header, sort_keys=True).encode())
        h.update(_content_sample(path, data_start, size, header))
    return h.digest()


def _content_sample(path: Path, data_start: int, size: int, header: dict, blocks: int = 64,
                    block_bytes: int = 4096, head_bytes: int = 256) -> bytes:
    """A digest of some of the file's data: `blocks` blocks spread evenly over it (all of it when small) and the
    first bytes of every tensor. Headers and sizes alone are those of any checkpoint of the same model: a node
    holding an older copy under the same path (a folder on its local disk, where rank 0 of another machine
    wrote the new one) passed the ranks' comparison and trained its replicas from the old weights."""
    import hashlib

    h = hashlib.sha1()
    span = size - data_start
    with open(path, "rb", buffering=0) as f:
        if span <= blocks * block_bytes:
            f.seek(data_start)
            h.update(f.read(span))
            return h.digest()
        step = span // blocks
        for i in range(blocks):
            f.seek(data_start + i * step)
            h.update(f.read(block_bytes))
        for name, entry in sorted(header.items()):
            if name == "__metadata__" or not isinstance(entry, dict) or "data_offsets" not in entry:
                continue
            begin, end = entry["data_offsets"]
            f.seek(data_start + begin)
            h.update(f.read(min(head_bytes, end - begin)))
    return h.digest()


class SafetensorsWriter:
    """Writes one .safetensors file a tensor at a time, in the order the header lists them."""

    def __init__(self, path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None = None):
        header, offset = {}, 0
        for name, dtype, shape in specs:
            size = dtype.itemsize
            for n in shape:
                size *= n
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.expected = [(name, header[name]["data_offsets"][1] - header[name]["data_offsets"][0])
                         for name, _, _ in specs]
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(text)) + text)
        self.written = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want, size = self.expected[self.written]
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        if name != want or data.nbytes != size:
            raise SpmdInternalError(f"SafetensorsWriter: got {name} ({data.nbytes} bytes), expected {want} ({size})")
        self.file.write(memoryview(data))
        self.written += 1

    def close(self) -> None:
        self.file.close()
        if self.written != len(self.expected):
            raise SpmdInternalError(f"SafetensorsWriter: {self.written} of {len(self.expected)} tensors written")


def atomic_path(path) -> tuple[Path, Path]:
    """(a temporary name next to `path`, `path`): written under the first, renamed when complete."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.tmp"), path

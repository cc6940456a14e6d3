"""Checkpoints as Hugging Face writes them (safetensors), read and written without any rank holding the
whole model.

    load_safetensors   each rank reads only its slices of each tensor (`safe_open(...).get_slice(name)`),
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
import os
import struct
from pathlib import Path

import torch

from spmd.core.errors import SpmdError

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
INDEX = "model.safetensors.index.json"


def checkpoint_files(path) -> dict[str, Path]:
    """tensor name -> the file holding it: `path` is a .safetensors file, an index JSON, or a folder with
    either `model.safetensors` or the index."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        path = path / INDEX if (path / INDEX).exists() else path / "model.safetensors"
    if not path.exists():
        raise SpmdError(f"no checkpoint at {path}. What to do: pass a .safetensors file, an index "
                        f"({INDEX}) or the folder save_pretrained wrote.")
    if path.suffix == ".json":
        weight_map = json.loads(path.read_text())["weight_map"]
        return {name: path.parent / file for name, file in weight_map.items()}
    with safe_open(str(path), "pt") as f:
        return {name: path for name in f.keys()}


def read_local(files: dict[str, Path], name: str, index: tuple[slice, ...], dtype: torch.dtype,
               shape: tuple[int, ...]) -> torch.Tensor:
    """Only the `index` part of tensor `name`, in `dtype` (the checkpoint may hold another one)."""
    from safetensors import safe_open

    with safe_open(str(files[name]), "pt") as f:
        stored = f.get_slice(name)
        if tuple(stored.get_shape()) != tuple(shape):
            raise SpmdError(f"{files[name].name}: {name!r} has shape {tuple(stored.get_shape())}, the model's is "
                            f"{tuple(shape)}. What to do: load a checkpoint of this model's configuration.")
        return stored[index].to(dtype) if index else stored[...].to(dtype)


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
            raise AssertionError(f"SafetensorsWriter: got {name} ({data.nbytes} bytes), expected {want} ({size})")
        self.file.write(memoryview(data))
        self.written += 1

    def close(self) -> None:
        self.file.close()
        if self.written != len(self.expected):
            raise AssertionError(f"SafetensorsWriter: {self.written} of {len(self.expected)} tensors written")


def atomic_path(path) -> tuple[Path, Path]:
    """(a temporary name next to `path`, `path`): written under the first, renamed when complete."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.tmp"), path

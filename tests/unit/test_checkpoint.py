"""Safetensors checkpoints read and written piece by piece (runtime/checkpoint.py): `read_piece` /
`read_pieces` give exactly the slices of the full tensors (row ranges, column ranges in small blocks,
2-D nested placements, scalars, every dtype in DTYPES incl. bf16 and fp8); `SafetensorsWriter` writes
files the safetensors library reads back; `checkpoint_files` finds tensors in a file, an index JSON or
a folder; and the messages for a truncated file, a shape mismatch and a missing checkpoint."""
from __future__ import annotations

import itertools
import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import Replicate, Shard

from spmd.core.errors import SpmdError
from spmd.runtime.checkpoint import (DTYPES, SafetensorsWriter, atomic_path, checkpoint_files, read_header, read_piece,
                                     read_pieces)
from spmd.runtime.distribute import local_slices

R, S0, S1 = Replicate(), Shard(0), Shard(1)
MESH = (2, 2)
COORDS = list(itertools.product(range(2), range(2)))


def tensors() -> dict[str, torch.Tensor]:
    """One tensor of every dtype spmd maps, odd byte counts between them, a scalar, a 3-D one."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for dtype in DTYPES:
        shape = (8, 4)
        if dtype == torch.bool:
            out["bool"] = torch.rand(shape, generator=g) > 0.5
        elif dtype.is_floating_point:
            out[str(dtype).removeprefix("torch.")] = (torch.randn(shape, generator=g) * 4).to(dtype)
        else:
            out[str(dtype).removeprefix("torch.")] = torch.randint(-100 if dtype.is_signed else 0, 100, shape,
                                                                   generator=g, dtype=dtype)
    out["wide"] = torch.randn(4, 8, generator=g)
    out["odd_bf16"] = torch.randn(3, 3, generator=g).to(torch.bfloat16)     # 18 bytes: the f32 after it is unaligned
    out["after_odd"] = torch.randn(8, generator=g)
    out["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    out["cube"] = torch.randn(4, 6, 8, generator=g)
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (torch.equal has no fp8 kernel on CPU)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return torch.equal(a, b)


def fit(ps: tuple, shape: tuple) -> tuple:
    """`ps` where it cuts `shape` evenly (spmd shards are even), else Replicate on every axis."""
    pieces = [1] * len(shape)
    for axis, p in enumerate(ps):
        if isinstance(p, Shard):
            if p.dim >= len(shape):
                return (R, R)
            pieces[p.dim] *= MESH[axis]
    return ps if all(n % k == 0 for n, k in zip(shape, pieces)) else (R, R)


@pytest.fixture
def saved(tmp_path):
    ts = tensors()
    path = tmp_path / "model.safetensors"
    save_file(ts, path)
    return ts, path


@pytest.mark.parametrize("ps", [(S0, R), (S0, S0), (R, S1), (S0, S1), (S1, S0), (S1, S1)],
                         ids=["S0-R", "S0-S0", "R-S1", "S0-S1", "S1-S0", "S1-S1"])
def test_read_pieces_equal_the_full_tensors_slices_on_every_coordinate(saved, ps):
    """Row ranges (one read), column ranges (blocks of rows), and 2-D nested cuts; a scalar is whole."""
    ts, path = saved
    files = checkpoint_files(path)
    for c in COORDS:
        wanted = {}
        for name, t in ts.items():
            wanted[name] = (local_slices(tuple(t.shape), fit(ps, tuple(t.shape)), MESH, c), tuple(t.shape))
        got = dict(read_pieces(files, wanted))
        assert set(got) == set(ts)
        for name, t in ts.items():
            want = t[wanted[name][0]]
            assert same(got[name], want), (name, ps, c)
            assert got[name].is_contiguous()


def test_read_piece_of_a_column_range_in_blocks_smaller_than_a_row(saved):
    """block_bytes below one row, a few rows, and the whole tensor give the same piece."""
    ts, path = saved
    data_start, header = read_header(path)
    cases = [("float32", (slice(2, 7), slice(1, 3))), ("bfloat16", (slice(4, 8), slice(2, 4))), ("wide", (slice(0, 4), slice(4, 8))),
             ("cube", (slice(1, 4), slice(0, 6), slice(2, 6))), ("cube", (slice(0, 4), slice(3, 6), slice(0, 8))),
             ("bool", (slice(1, 3), slice(0, 2)))]
    with open(path, "rb", buffering=0) as f:
        for (name, index), block in itertools.product(cases, (1, 24, 100, 1 << 20)):
            got = read_piece(f, data_start, header[name], index, block_bytes=block)
            assert same(got, ts[name][index]), (name, index, block)


def test_pieces_are_copies_not_views_of_the_file(saved):
    ts, path = saved
    got = dict(read_pieces(checkpoint_files(path), {"float32": ((slice(0, 4), slice(0, 2)), (8, 4))}))["float32"]
    save_file({"float32": torch.zeros(8, 4)}, path)     # a later save to the same path
    assert got.untyped_storage().nbytes() == 4 * 2 * 4
    assert torch.equal(got, ts["float32"][:4, :2])


def test_safetensors_writer_round_trip_read_by_the_safetensors_library(tmp_path):
    ts = tensors()
    ts["transposed"] = torch.arange(24.0).reshape(4, 6).t()            # not contiguous: written row-major
    tmp, final = atomic_path(tmp_path / "out.safetensors")
    assert tmp.parent == final.parent and tmp.name.startswith(".") and tmp != final
    writer = SafetensorsWriter(tmp, [(n, t.dtype, tuple(t.shape)) for n, t in ts.items()], {"format": "pt", "step": 3})
    for n, t in ts.items():                                            # one tensor at a time
        writer.write(n, t)
    writer.close()
    os.replace(tmp, final)
    raw = final.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    assert header_len % 8 == 0 and len(raw) == 8 + header_len + sum(t.numel() * t.element_size() for t in ts.values())
    back = load_file(final)
    assert set(back) == set(ts)
    assert all(same(back[n], t.contiguous()) for n, t in ts.items()), [n for n, t in ts.items() if not same(back[n], t)]
    with safe_open(final, "pt") as f:
        assert f.metadata() == {"format": "pt", "step": "3"}
        assert torch.equal(f.get_slice("cube")[1:3, :, 2:4], ts["cube"][1:3, :, 2:4])
    got = dict(read_pieces(checkpoint_files(final), {"bfloat16": ((slice(0, 8), slice(2, 4)), (8, 4))}))
    assert same(got["bfloat16"], ts["bfloat16"][:, 2:4])


def test_checkpoint_files_for_a_file_an_index_and_a_folder(tmp_path):
    ts = tensors()
    names = sorted(ts)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, ns in parts.items():
        save_file({n: ts[n] for n in ns}, tmp_path / file)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {n: f for f, ns in parts.items() for n in ns}}))
    expected = {n: tmp_path / f for f, ns in parts.items() for n in ns}
    assert checkpoint_files(index) == expected
    assert checkpoint_files(tmp_path) == expected                     # a folder with an index
    one = tmp_path / "model-00002-of-00002.safetensors"
    assert checkpoint_files(one) == {n: one for n in names[1::2]}
    single = tmp_path / "single"
    single.mkdir()
    save_file(ts, single / "model.safetensors", metadata={"format": "pt"})
    assert checkpoint_files(single) == {n: single / "model.safetensors" for n in names}   # no "__metadata__"
    wanted = {n: (local_slices(tuple(ts[n].shape), (S0, R) if ts[n].dim() else (R, R), MESH, (1, 0)),
                  tuple(ts[n].shape)) for n in names}
    got = dict(read_pieces(checkpoint_files(tmp_path), wanted))             # from both shard files
    assert all(same(got[n], ts[n][wanted[n][0]]) for n in names)


def test_missing_checkpoint_names_the_path_and_what_to_pass(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpmdError, match=r"no checkpoint at .*empty/model.safetensors\. What to do: pass a "
                                        r"\.safetensors file, an index"):
        checkpoint_files(tmp_path / "empty")


def test_truncated_file_is_named_as_truncated(saved):
    ts, path = saved
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    _, header = read_header(path)
    last = max(header.items(), key=lambda kv: kv[1]["data_offsets"][1] if kv[0] != "__metadata__" else -1)[0]
    shape = tuple(ts[last].shape)
    with pytest.raises(SpmdError, match=rf"model.safetensors: the file ends before byte {len(data)} "
                                        r"\(a truncated checkpoint\)"):
        dict(read_pieces(checkpoint_files(path), {last: (tuple(slice(0, n) for n in shape), shape)}))


def test_shape_mismatch_names_both_shapes(saved):
    _, path = saved
    with pytest.raises(SpmdError, match=r"model.safetensors: 'cube' has shape \(4, 6, 8\), the model's is "
                                        r"\(4, 6, 4\)\. What to do: load a checkpoint of this model's configuration"):
        dict(read_pieces(checkpoint_files(path), {"cube": ((slice(0, 4), slice(0, 6), slice(0, 4)), (4, 6, 4))}))


def test_a_cut_header_or_a_missing_shard_names_the_file(tmp_path):
    (tmp_path / "tiny.safetensors").write_bytes(b"\x10\x00")  # shorter than the 8-byte header length
    with pytest.raises(SpmdError, match=r"tiny.safetensors: not a safetensors file, or its header is cut short"):
        checkpoint_files(tmp_path / "tiny.safetensors")
    (tmp_path / "cut.safetensors").write_bytes(struct.pack("<Q", 100) + b'{"w": {"dtype"')
    with pytest.raises(SpmdError, match=r"cut.safetensors: not a safetensors file"):
        checkpoint_files(tmp_path / "cut.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(SpmdError, match=r"names shard files that are not there: model-00001-of-00002.safetensors"):
        checkpoint_files(tmp_path)


def test_unsigned_integers_round_trip(tmp_path):
    t = torch.arange(12, dtype=torch.int32).to(torch.uint16).reshape(3, 4)
    writer = SafetensorsWriter(tmp_path / "u.safetensors", [("u", t.dtype, tuple(t.shape))])
    writer.write("u", t)
    writer.close()
    data_start, header = read_header(tmp_path / "u.safetensors")
    with open(tmp_path / "u.safetensors", "rb") as f:
        assert torch.equal(read_piece(f, data_start, header["u"], (slice(0, 3), slice(1, 3))), t[:, 1:3])

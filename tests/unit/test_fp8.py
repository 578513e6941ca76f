"""Safetensors FP8 and unsigned-int dtypes: read back bitwise from files the safetensors library wrote."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_zoo.errors import CheckpointFormatError
from mcore_zoo.weights.io import HFCheckpoint, write_safetensors


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# ---------------------------------------------------------------------------- safetensors dtypes


def test_reader_new_dtypes_bitwise(tmp_path):
    gen = torch.Generator().manual_seed(0)
    raw = lambda *shape: torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)  # noqa: E731
    tensors = {
        "e4m3": raw(6, 10).view(torch.float8_e4m3fn),  # all byte patterns, NaNs included
        "e5m2": raw(6, 10).view(torch.float8_e5m2),
        "u16": raw(4, 8).view(torch.uint16),
        "u32": raw(4, 16).view(torch.uint32),
        "u64": raw(4, 32).view(torch.uint64),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    header_dtypes = {k: v["dtype"] for k, v in _header(tmp_path / "model.safetensors").items() if k != "__metadata__"}
    assert header_dtypes == {"e4m3": "F8_E4M3", "e5m2": "F8_E5M2", "u16": "U16", "u32": "U32", "u64": "U64"}
    with HFCheckpoint(tmp_path) as ckpt:
        for name, tensor in tensors.items():
            assert ckpt.dtype(name) == tensor.dtype
            assert same_bits(ckpt.read(name), tensor), name
            assert same_bits(ckpt.read(name, axis=0, rank=1, size=2), tensor.chunk(2, 0)[1]), name
            out = torch.empty(tensor.shape, dtype=tensor.dtype)
            ckpt.read_into(name, out)
            assert same_bits(out, tensor), name
    # and the writer: safetensors reads back what write_safetensors wrote
    write_safetensors(tmp_path / "again.safetensors", tensors)
    back = load_file(str(tmp_path / "again.safetensors"))
    assert all(same_bits(back[k], v) for k, v in tensors.items())


def test_reader_refuses_other_quantized_dtypes(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2, 2, dtype=torch.uint8)}, str(path))
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header["w"]["dtype"] = "F8_E8M0"
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + length :])
    with pytest.raises(CheckpointFormatError, match="F8_E8M0"):
        HFCheckpoint(tmp_path)


def _header(path: Path) -> dict:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length])

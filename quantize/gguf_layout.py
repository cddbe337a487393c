"""Check a GGUF file's header against the file's size before gguf's GGUFReader trusts it.

GGUFReader believes every count, length and offset in the header: a corrupted array count makes it build
per-element parts in a Python loop until the machine runs out of memory, and a tensor count or tensor offset
past the end of the file surfaces as numpy's "index 0 is out of bounds" or "cannot reshape array of size …".
`check_layout` walks the header as the GGUF spec lays it out (ggml's docs/gguf.md) and names the first thing
that does not fit: the metadata entry, the tensor, and the bytes it needs against the bytes there are.

Layout (little-endian; big-endian files and other versions are left to GGUFReader's own checks):
    magic u32 "GGUF" | version u32 (2 or 3) | tensor_count u64 | kv_count u64
    kv_count x (key: string | value_type u32 | value)               string = u64 length + UTF-8 bytes
    tensor_count x (name: string | n_dims u32 | n_dims x u64 dims, innermost first | type u32 | offset u64)
    padding to general.alignment (u32, default 32) | tensor data, each at data start + its offset
"""
from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from quantize.checkpoint import CheckpointError

GGUF_MAGIC = 0x46554747  # "GGUF" read as a little-endian u32
SUPPORTED_VERSIONS = (2, 3)  # version 1 had 32-bit counts; GGUFReader refuses it by name
DEFAULT_ALIGNMENT = 32
# Byte sizes of GGUF's scalar value types (gguf.GGUFValueType): 0-7 u8 i8 u16 i16 u32 i32 f32 bool, 10-12 u64 i64 f64.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_UINT32, _STRING, _ARRAY = 4, 8, 9
_MIN_KV_BYTES = 8 + 4  # a key's length and a value type, at least
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # a name's length, n_dims, type and offset, at least


class _Cursor:
    """Reads the header in order; every read is checked against the file's size first."""

    def __init__(self, path: Path, buf: mmap.mmap):
        self.path, self.buf, self.offset, self.size = path, buf, 0, len(buf)

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a readable GGUF file ({message})")

    def skip(self, n: int, what: str = "metadata") -> int:
        if n < 0 or self.offset + n > self.size:
            raise self.error(f"{what} runs past the end of the file at byte {self.offset}")
        start, self.offset = self.offset, self.offset + n
        return start

    def unpack(self, fmt: str, what: str = "metadata") -> int:
        start = self.skip(struct.calcsize(fmt), what)
        return struct.unpack_from("<" + fmt, self.buf, start)[0]

    def string(self, what: str = "metadata") -> bytes:
        n = self.unpack("Q", what)
        start = self.skip(n, what)
        return bytes(self.buf[start:self.offset])

    def value(self, vtype: int, depth: int = 0) -> None:
        """Skip one metadata value of type vtype (arrays of arrays nest two deep at most)."""
        if vtype in _SCALAR_BYTES:
            self.skip(_SCALAR_BYTES[vtype])
        elif vtype == _STRING:
            self.skip(self.unpack("Q"))
        elif vtype == _ARRAY and depth < 2:
            itype, count = self.unpack("I"), self.unpack("Q")
            if itype in _SCALAR_BYTES:
                self.skip(count * _SCALAR_BYTES[itype])
                return
            start = self.offset
            self.skip(count * 8)  # each string or nested array needs 8 bytes at least: bounds the loop below
            self.offset = start
            for _ in range(count):
                self.value(itype, depth + 1)
        else:
            raise self.error(f"unknown metadata value type {vtype}")


def check_layout(path: Path) -> None:
    """CheckpointError naming the file and what does not fit in it, unless every metadata value, every tensor
    description and every tensor's data lie inside the file."""
    with open(path, "rb") as f:
        if (size := f.seek(0, 2)) < 24:
            raise CheckpointError(f"{path}: not a readable GGUF file (it is {size} bytes; a GGUF header alone "
                                  "takes 24)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            c = _Cursor(path, buf)
            if c.unpack("I") != GGUF_MAGIC or c.unpack("I") not in SUPPORTED_VERSIONS:
                return  # GGUFReader names a bad magic or version itself
            tensor_count, kv_count = c.unpack("Q"), c.unpack("Q")
            alignment = _walk_metadata(c, kv_count)
            tensors = _walk_tensor_infos(c, tensor_count)
            data_start = -(-c.offset // alignment) * alignment
            _check_tensor_data(path, c.size, data_start, tensors)


def _walk_metadata(c: _Cursor, kv_count: int) -> int:
    """Skip the key/value section; returns general.alignment (GGUFReader checks its type and value)."""
    start = c.offset
    c.skip(kv_count * _MIN_KV_BYTES)
    c.offset = start
    alignment = DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key = c.string()
        vtype = c.unpack("I")
        if key == b"general.alignment" and vtype == _UINT32:
            alignment = c.unpack("I")
        else:
            c.value(vtype)
    return alignment if alignment > 0 and not alignment & (alignment - 1) else DEFAULT_ALIGNMENT


def _walk_tensor_infos(c: _Cursor, tensor_count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, dims innermost first, GGML type, offset) of every tensor the header describes."""
    needed = c.offset + tensor_count * _MIN_TENSOR_INFO_BYTES
    if needed > c.size:
        raise CheckpointError(f"{c.path}: not a readable GGUF file (the header lists {tensor_count} tensors: the "
                              f"file ends at byte {c.size}; their descriptions alone need bytes up to {needed})")
    tensors = []
    for i in range(tensor_count):
        what = f"the description of tensor {i}"
        name = c.string(what).decode("utf-8", errors="replace")
        what = f"the description of tensor {name}"
        n_dims = c.unpack("I", what)
        start = c.skip(n_dims * 8, what)
        dims = struct.unpack_from(f"<{n_dims}Q", c.buf, start)
        tensors.append((name, dims, c.unpack("I", what), c.unpack("Q", what)))
    return tensors


def _check_tensor_data(path: Path, size: int, data_start: int, tensors) -> None:
    for name, dims, raw_type, offset in tensors:
        try:
            ggml_type = GGMLQuantizationType(raw_type)
            block, type_bytes = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise CheckpointError(f"{path}: tensor {name} has unknown GGML type {raw_type}") from None
        if dims and dims[0] % block:
            raise CheckpointError(f"{path}: tensor {name}'s rows of {dims[0]} values are not a whole number of "
                                  f"{ggml_type.name} blocks ({block} values each)")
        end = data_start + offset + math.prod(dims) // block * type_bytes
        if end > size:
            raise CheckpointError(f"{path}: the file ends at byte {size}; tensor {name} needs bytes up to {end} "
                                  "(a file cut short, or a corrupt tensor offset or shape)")

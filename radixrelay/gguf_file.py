"""A GGUF file (llama.cpp's format) opened for its metadata and tensor table, without the ``gguf``
package's reader.

``gguf.GGUFReader`` builds a numpy view per field part; a tokenizer vocabulary of ~100k strings
makes that seconds of CPU per open, paid by every process that loads the tokenizer or the model.
Here the header is parsed straight from the bytes (``struct`` for scalars, one pass per string array,
``numpy.frombuffer`` for numeric arrays), and tensor data stays memory-mapped until it is asked for.

Layout (versions 2 and 3, little-endian): magic ``GGUF``, version u32, tensor count u64, metadata
count u64; each metadata entry is a key (u64 length + UTF-8 bytes), a value type u32 and the value
(an array is an item type u32, a count u64 and the items); each tensor entry is a name, a dimension
count u32, the dimensions (u64 each, innermost first), a ggml type u32 and an offset u64 into the data
section, which starts at the next multiple of ``general.alignment`` (default 32) after the table.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# value type -> (struct format, numpy dtype) for fixed-size scalars; 8 is a string, 9 an array.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
    5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "<u1"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class GGUFError(ValueError):
    """The file is not a GGUF file this reader understands (with the reason and the path)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]        # as stored: innermost first (torch order is ``reversed(dims)``)
    ggml_type: int               # gguf.GGMLQuantizationType value
    offset: int                  # byte offset into the file
    nbytes: int


class GGUFFile:
    """``metadata``: key -> Python value (ints, floats, bools, strings, lists of them);
    ``tensors``: the tensor table in file order; ``tensor_bytes(t)``: a read-only uint8 view of the
    tensor's data (memory-mapped; valid while this object lives)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:          # an empty file cannot be mapped
                raise GGUFError(f"{self.path}: not a GGUF file ({e})") from None
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise GGUFError(f"{self.path}: truncated or malformed GGUF header ({e})") from None

    def tensor_bytes(self, tensor: TensorInfo) -> np.ndarray:
        return np.frombuffer(self._map, dtype=np.uint8, count=tensor.nbytes, offset=tensor.offset)

    def _parse(self) -> tuple[dict[str, Any], list[TensorInfo]]:
        buf = self._map
        if buf[:4] != MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        version = _U32.unpack_from(buf, 4)[0]
        if version not in SUPPORTED_VERSIONS:
            swapped = struct.unpack("<I", struct.pack(">I", version))[0]
            why = "a big-endian file" if swapped in SUPPORTED_VERSIONS else f"version {version}"
            raise GGUFError(f"{self.path}: {why} is not supported (little-endian GGUF v2/v3 only)")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            kind = _U32.unpack_from(buf, pos)[0]
            metadata[key], pos = _value(buf, pos + 4, kind)
        raw: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            n_dims = _U32.unpack_from(buf, pos)[0]
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            pos += 4 + 8 * n_dims
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            raw.append((name, tuple(int(d) for d in dims), ggml_type, offset))
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-pos // alignment) * alignment
        tensors = []
        for name, dims, ggml_type, offset in raw:
            nbytes = _tensor_nbytes(name, dims, ggml_type)
            start = data_start + offset
            if start + nbytes > len(buf):
                raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file")
            tensors.append(TensorInfo(name, dims, ggml_type, start, nbytes))
        return metadata, tensors


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a GGUF file (see ``GGUFFile``)."""
    return GGUFFile(path).metadata


def _string(buf: Any, pos: int) -> tuple[str, int]:
    n = _U64.unpack_from(buf, pos)[0]
    end = pos + 8 + n
    if end > len(buf):
        raise IndexError("a string runs past the end of the file")
    return bytes(buf[pos + 8:end]).decode("utf-8"), end


def _value(buf: Any, pos: int, kind: int) -> tuple[Any, int]:
    if kind == _STRING:
        return _string(buf, pos)
    if kind in _SCALARS:
        fmt = _SCALARS[kind][0]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if kind != _ARRAY:
        raise GGUFError(f"unknown metadata value type {kind}")
    item, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item in _SCALARS:
        dtype = np.dtype(_SCALARS[item][1])
        end = pos + count * dtype.itemsize
        if end > len(buf):
            raise IndexError("an array runs past the end of the file")
        values = np.frombuffer(buf, dtype=dtype, count=count, offset=pos).tolist()
        return ([bool(v) for v in values] if item == _BOOL else values), end
    if item == _STRING:
        out = []
        unpack = _U64.unpack_from
        for _ in range(count):
            n = unpack(buf, pos)[0]
            out.append(buf[pos + 8:pos + 8 + n])
            pos += 8 + n
        if pos > len(buf):
            raise IndexError("a string array runs past the end of the file")
        return [b.decode("utf-8") for b in out], pos
    values = []
    for _ in range(count):                   # arrays of arrays: rare, small
        v, pos = _value(buf, pos, item)
        values.append(v)
    return values, pos


def _tensor_nbytes(name: str, dims: tuple[int, ...], ggml_type: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"tensor {name} has ggml type {ggml_type}, which the installed gguf package does "
                        "not know") from None
    elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
    if dims and dims[0] % block:
        raise GGUFError(f"tensor {name}: row length {dims[0]} is not a multiple of its block size {block}")
    return elements // block * type_size

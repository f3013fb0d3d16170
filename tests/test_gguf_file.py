"""radixrelay.gguf_file reads what the ``gguf`` package reads (metadata of every value type, the
tensor table and each tensor's bytes), and refuses what is not a GGUF file with a clear error; the
torch dequantisation of F32/F16/BF16/Q8_0/Q4_0/Q4_1 equals ``gguf.quants`` bit for bit."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from radixrelay.gguf_file import GGUFError, GGUFFile, read_metadata
from radixrelay.model.model_registry import resolve_model_path
from radixrelay.model.weights_gguf import dequantize

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def _same_as_gguf_reader(path) -> None:
    ours = GGUFFile(path)
    ref = gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == expected.keys()
    for key, value in expected.items():
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors):
        assert mine.dims == tuple(int(d) for d in theirs.shape)
        assert mine.ggml_type == int(theirs.tensor_type)
        assert np.array_equal(ours.tensor_bytes(mine), np.asarray(theirs.data).view(np.uint8).reshape(-1))


def test_embedded_model_reads_like_the_gguf_package():
    path = resolve_model_path("default")
    path = next(path.glob("*.gguf")) if path.is_dir() else path
    _same_as_gguf_reader(path)
    meta = read_metadata(path)
    assert len(meta["tokenizer.ggml.tokens"]) == len(meta["tokenizer.ggml.token_type"]) > 40_000


def _write(path, tensors=()) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.strs", ["a", "", "ü b"])
    w.add_array("t.bools", [True, False])
    for name, array, qtype in tensors:
        w.add_tensor(name, array, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_value_type_and_tensor_type_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    tensors = [("a", x, None), ("b", x.astype(np.float16), None),
               ("c", gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0), ("d", x[:1, :32].copy(), None)]
    _write(tmp_path / "t.gguf", tensors)
    _same_as_gguf_reader(tmp_path / "t.gguf")
    meta = read_metadata(tmp_path / "t.gguf")
    assert meta["t.u64"] == 2**63 + 5 and meta["t.str"] == "héllo ✓" and meta["t.bools"] == [True, False]
    assert meta["t.strs"] == ["a", "", "ü b"]


def test_what_is_not_a_gguf_file_is_refused_with_its_path(tmp_path):
    _write(tmp_path / "ok.gguf", [("a", np.ones((2, 32), np.float32), None)])
    good = (tmp_path / "ok.gguf").read_bytes()
    cases = {
        "empty.gguf": (b"", "not a GGUF file"),
        "text.gguf": (b"hello world, not a model" * 4, "not a GGUF file"),
        "v1.gguf": (good[:4] + struct.pack("<I", 1) + good[8:], "version 1"),
        "big.gguf": (good[:4] + struct.pack(">I", 3) + good[8:], "big-endian"),
        "header.gguf": (good[:200], "truncated or malformed"),
        "data.gguf": (good[:-64], "runs past the end"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(GGUFError, match=message) as info:
            GGUFFile(tmp_path / name)
        assert name in str(info.value)


def _random_blocks(rng, qtype, blocks: int) -> np.ndarray:
    size = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}[qtype]
    raw = rng.integers(0, 256, size=(blocks, size), dtype=np.uint8)
    scales = 1 + (2 if qtype == Q.Q4_1 else 0)          # f16 scale (and minimum) at the start
    for i in range(0, 2 * scales, 2):
        raw[:, i:i + 2] = rng.standard_normal(blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    return raw.reshape(-1)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F32, Q.F16, Q.BF16, Q.Q5_0],
                         ids=lambda q: q.name)
def test_dequantize_equals_the_gguf_package(qtype):
    rng = np.random.default_rng(int(qtype))
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        raw = _random_blocks(rng, qtype, 96)
    elif qtype == Q.BF16:
        raw = torch.randn(256, generator=torch.Generator().manual_seed(0)).bfloat16().view(torch.uint8).numpy()
    elif qtype == Q.Q5_0:                                # not done here: the gguf package's code
        raw = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), qtype).reshape(-1)
    else:
        dtype = np.float32 if qtype == Q.F32 else np.float16
        raw = rng.standard_normal(256).astype(dtype).view(np.uint8)
    ours = dequantize(raw, int(qtype))
    assert ours.dtype == torch.float32
    assert np.array_equal(ours.numpy(), gguf.quants.dequantize(raw, qtype).reshape(-1))

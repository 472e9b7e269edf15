"""The GGUF writer and encoders, read back with gguf-py's reader and checked against its quantizers."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kiln.core.errors import InvalidInput, StageFailed
from kiln.formats.gguf.constants import GGUF_ALIGNMENT, GGUF_MAGIC, Keys, TensorType, ValueType
from kiln.formats.gguf.quants import F16Overflow, encode, quantize_mxfp4, quantize_nvfp4, quantize_q4_0, quantize_q8_0
from kiln.formats.gguf.writer import GGUFWriter, WriterMisuse, WriterState
from tests.file_builders import gguf_bytes, gguf_string


def _written(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray] = {
        "a.weight": rng.standard_normal((3, 5)).astype(np.float32),  # 60 bytes: exercises padding
        "b.weight": rng.standard_normal((4, 64)).astype(np.float16),
        "c.weight": rng.standard_normal((2, 64)).astype(np.float32),
    }
    path = tmp_path / "m.gguf"
    with GGUFWriter(path) as w:
        w.add_string(Keys.ARCHITECTURE, "llama")
        w.add_uint32("llama.block_count", 2)
        w.add_float32("llama.rope.freq_base", 10000.0)
        w.add_bool("tokenizer.ggml.add_bos_token", False)
        w.add_array("tokenizer.ggml.tokens", ["a", "b c", "é"], ValueType.STRING)
        w.add_array("tokenizer.ggml.token_type", [1, 3, 4], ValueType.INT32)
        w.plan_tensor("a.weight", (3, 5), TensorType.F32)
        w.plan_tensor("b.weight", (4, 64), TensorType.F16)
        w.plan_tensor("c.weight", (2, 64), TensorType.Q8_0)
        w.begin()
        w.write_tensor("a.weight", tensors["a.weight"])
        w.write_tensor("b.weight", iter([tensors["b.weight"][:2], tensors["b.weight"][2:]]))  # chunked
        w.write_tensor("c.weight", gguf.quants.quantize(tensors["c.weight"], gguf.GGMLQuantizationType.Q8_0))
        assert w.finish() == path
    return path, tensors


def test_written_file_reads_back_with_gguf_reader(tmp_path: Path) -> None:
    path, tensors = _written(tmp_path)
    r = gguf.GGUFReader(path)
    assert r.fields[Keys.ARCHITECTURE].contents() == "llama"
    assert r.fields["llama.block_count"].contents() == 2
    assert r.fields["llama.rope.freq_base"].contents() == pytest.approx(10000.0)
    assert r.fields["tokenizer.ggml.add_bos_token"].contents() is False
    assert r.fields["tokenizer.ggml.tokens"].contents() == ["a", "b c", "é"]
    assert r.fields["tokenizer.ggml.token_type"].contents() == [1, 3, 4]
    assert r.fields[Keys.ALIGNMENT].contents() == GGUF_ALIGNMENT
    by_name = {t.name: t for t in r.tensors}
    assert [t.name for t in r.tensors] == ["a.weight", "b.weight", "c.weight"]
    assert list(by_name["a.weight"].shape) == [5, 3]  # ggml order: row length first
    assert by_name["c.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    for t in r.tensors:
        assert t.data_offset % GGUF_ALIGNMENT == 0
    np.testing.assert_array_equal(by_name["a.weight"].data, tensors["a.weight"])
    np.testing.assert_array_equal(by_name["b.weight"].data, tensors["b.weight"])
    deq = gguf.quants.dequantize(by_name["c.weight"].data, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_allclose(deq, tensors["c.weight"], atol=0.03)
    assert not list(tmp_path.glob(".*partial"))


def test_misuse_of_the_state_machine_raises(tmp_path: Path) -> None:
    w = GGUFWriter(tmp_path / "m.gguf")
    w.plan_tensor("t", (32,), TensorType.F32)
    with pytest.raises(WriterMisuse, match="state EMPTY"):
        w.write_tensor("t", np.zeros(32, np.float32))
    with pytest.raises(WriterMisuse, match="state EMPTY"):
        w.finish()
    with pytest.raises(WriterMisuse, match="planned twice"):
        w.plan_tensor("t", (32,), TensorType.F32)
    with pytest.raises(WriterMisuse, match="block size|multiple"):
        w.plan_tensor("q", (2, 48), TensorType.Q8_0)
    w.write_header()
    with pytest.raises(WriterMisuse, match="state HEADER"):
        w.add_uint32("late.key", 1)
    with pytest.raises(WriterMisuse, match="state HEADER"):
        w.write_tensor_infos()
    w.write_kv()
    w.write_tensor_infos()
    with pytest.raises(WriterMisuse, match="state TENSOR_INFO"):
        w.plan_tensor("u", (32,), TensorType.F32)
    with pytest.raises(WriterMisuse, match="out of order"):
        w.write_tensor("u", np.zeros(32, np.float32))
    w.write_tensor("t", np.zeros(32, np.float32))
    with pytest.raises(WriterMisuse, match="not planned"):
        w.write_tensor("t", np.zeros(32, np.float32))
    w.finish()
    assert w.state is WriterState.DONE
    with pytest.raises(WriterMisuse, match="state DONE"):
        w.write_header()


@pytest.mark.parametrize("nbytes", [31 * 4, 33 * 4])
def test_written_size_must_match_the_plan_and_leaves_no_file(tmp_path: Path, nbytes: int) -> None:
    path = tmp_path / "m.gguf"
    with pytest.raises(StageFailed) as e, GGUFWriter(path) as w:
        w.plan_tensor("t", (32,), TensorType.F32)
        w.begin()
        w.write_tensor("t", np.zeros(nbytes // 4, np.float32))
    assert e.value.code == "GGUF_SIZE_MISMATCH"
    assert "'t'" in e.value.message and "128" in e.value.message
    assert list(tmp_path.iterdir()) == []


def test_a_tensor_never_written_fails_finish_and_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    with pytest.raises(StageFailed, match="never written.*'u'") as e, GGUFWriter(path) as w:
        w.plan_tensor("t", (32,), TensorType.F32)
        w.plan_tensor("u", (32,), TensorType.F32)
        w.begin()
        w.write_tensor("t", np.zeros(32, np.float32))
        w.finish()
    assert e.value.code == "GGUF_SIZE_MISMATCH"
    assert list(tmp_path.iterdir()) == []


def _edge_rows() -> np.ndarray:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 256)).astype(np.float32) * rng.uniform(1e-3, 50, (16, 1)).astype(np.float32)
    x[0] = 0.0
    x[1, :32] = -0.0
    x[2, :32] = np.array([-0.0] + [0.0] * 31, dtype=np.float32)
    x[3, :32] = np.arange(32, dtype=np.float32) - 16  # exact .5 after scaling: rounding ties
    x[4, :32] = np.array([127.0] + [63.5] * 31, dtype=np.float32)
    x[5, :32] = np.array([-127.0] + [0.49999997] * 15 + [-1.5] * 16, dtype=np.float32)
    x[6, :32] = np.array([8.0] + [-8.0] * 31, dtype=np.float32)  # |max| tie, first wins
    x[7, :32] = np.array([-8.0] + [8.0] * 31, dtype=np.float32)
    x[8] = 1e-30  # subnormal scales
    return x


@pytest.mark.parametrize(
    ("ours", "qtype"),
    [(quantize_q8_0, "Q8_0"), (quantize_q4_0, "Q4_0"), (quantize_mxfp4, "MXFP4")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantizers_are_bit_exact_with_gguf_py(ours, qtype: str, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    t = torch.from_numpy(_edge_rows()).to(dtype)
    coarse = (torch.randint(-4, 5, (64, 128)) * 0.25).to(dtype)  # many equal magnitudes: ties everywhere
    for x in (t, coarse, torch.randn(300, 96).to(dtype)):
        ref = gguf.quants.quantize(x.to(torch.float32).numpy(), gguf.GGMLQuantizationType[qtype])
        np.testing.assert_array_equal(ours(x), ref)
        streamed = np.concatenate([c.reshape(-1) for c in encode(x, TensorType[qtype])])
        np.testing.assert_array_equal(streamed, ref.reshape(-1))


def test_fp4_types_are_llama_cpps_own_bytes() -> None:
    """MXFP4 (kiln's port) equals ggml's own quantizer in the pinned llama.cpp byte for byte; NVFP4 is that
    quantizer, and gguf-py reads it back as blocks of 16 E2M1 values under one E4M3 scale."""
    import ctypes

    from llama_cpp import _ggml

    chunk = _ggml.libggml.ggml_quantize_chunk
    chunk.restype = ctypes.c_size_t
    chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    for x in (torch.from_numpy(_edge_rows()), torch.randn(300, 128) * 0.02, torch.randn(8, 4096) * 3):
        rows = x.to(torch.float32).contiguous().numpy()
        ggml = np.empty((rows.shape[0], rows.shape[1] // 32 * 17), dtype=np.uint8)
        chunk(int(TensorType.MXFP4), rows.ctypes.data, ggml.ctypes.data, 0, rows.shape[0], rows.shape[1], None)
        np.testing.assert_array_equal(quantize_mxfp4(x), ggml)
    x = torch.randn(64, 512) * 0.02
    nv = quantize_nvfp4(x)
    assert nv.shape == (64, 512 // 64 * 36)
    back = gguf.quants.dequantize(nv, gguf.GGMLQuantizationType.NVFP4)
    err = np.sqrt(((back - x.numpy()) ** 2).mean() / (x.numpy() ** 2).mean())
    assert 0.02 < err < 0.15, err  # 4-bit values: about 10 % RMS error, never exact, never garbage
    streamed = np.concatenate([c.reshape(-1) for c in encode(x, TensorType.NVFP4)])
    np.testing.assert_array_equal(streamed, nv.reshape(-1))


def test_encode_f16_and_bf16_bytes() -> None:
    x = torch.randn(70, 33, dtype=torch.bfloat16)
    f16 = np.concatenate([c.reshape(-1) for c in encode(x, TensorType.F16)])
    np.testing.assert_array_equal(f16, x.to(torch.float32).numpy().astype(np.float16).reshape(-1))
    bf16 = np.concatenate([c.reshape(-1) for c in encode(x, TensorType.BF16)])
    np.testing.assert_array_equal(bf16.view(np.uint16), x.view(torch.int16).numpy().view(np.uint16).reshape(-1))
    with pytest.raises(F16Overflow, match="65504"):
        list(encode(torch.full((4, 4), 1e6, dtype=torch.bfloat16), TensorType.F16))


@pytest.mark.parametrize(("value", "in_place"), [("gpt-2", True), ("qwen2", True), ("a-much-longer-name" * 4, False)])
def test_metadata_can_be_corrected_after_the_weights(tmp_path: Path, value: str, in_place: bool) -> None:
    """The exporter streams weights on predicted metadata and fixes the header afterwards."""
    from kiln.formats.gguf.writer import Metadata

    data = np.arange(64 * 40, dtype=np.float32).reshape(40, 64)
    path = tmp_path / "m.gguf"
    with GGUFWriter(path) as w:
        w.add_string("tokenizer.ggml.pre", "llama")
        w.plan_tensor("a", (40, 64), TensorType.F32)
        w.plan_tensor("b", (64,), TensorType.F32)
        w.begin()
        w.write_tensor("a", data)
        fixed = Metadata()
        fixed.add_string("tokenizer.ggml.pre", value)
        assert w.rewrite_metadata(fixed) is in_place
        w.write_tensor("b", data[0])
        w.finish()
    r = gguf.GGUFReader(path)
    assert r.fields["tokenizer.ggml.pre"].contents() == value
    tensors = {t.name: t for t in r.tensors}
    np.testing.assert_array_equal(tensors["a"].data, data)
    np.testing.assert_array_equal(tensors["b"].data, data[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_header_reader_agrees_with_gguf_py(tmp_path: Path) -> None:
    from kiln.formats.gguf.reader import read_header

    path, _ = _written(tmp_path)
    header = read_header(path)
    ref = gguf.GGUFReader(path)
    assert header.metadata["tokenizer.ggml.tokens"] == ["a", "b c", "é"]
    assert header.metadata["llama.rope.freq_base"] == pytest.approx(10000.0)
    assert header.metadata["tokenizer.ggml.add_bos_token"] is False
    assert header.tensor_types() == {"a.weight": "F32", "b.weight": "F16", "c.weight": "Q8_0"}
    assert [t.shape for t in header.tensors] == [(3, 5), (4, 64), (2, 64)]
    assert [header.data_offset + t.offset for t in header.tensors] == [t.data_offset for t in ref.tensors]


# --- the header reader is a trust boundary: every malformed file is one GGUF_INVALID --------------------------


def _gguf_error(tmp_path: Path, raw: bytes) -> InvalidInput:
    from kiln.formats.gguf.reader import read_header

    path = tmp_path / "bad.gguf"
    path.write_bytes(raw)
    with pytest.raises(InvalidInput) as e:
        read_header(path)
    assert e.value.code == "GGUF_INVALID", e.value.message
    assert e.value.message.startswith(str(path))
    return e.value


def _header(n_tensors: int, n_kv: int) -> bytes:
    return struct.pack("<IIQQ", GGUF_MAGIC, 3, n_tensors, n_kv)


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (gguf_bytes([(Keys.ALIGNMENT, ValueType.UINT32, 0)]), "alignment 0 is not a power of two"),
        (gguf_bytes([(Keys.ALIGNMENT, ValueType.UINT32, 48)]), "alignment 48 is not a power of two"),
        (gguf_bytes([(Keys.ALIGNMENT, ValueType.STRING, "32")]), "must be a UINT32, not STRING"),
        (gguf_bytes([(Keys.ALIGNMENT, ValueType.INT32, -32)]), "must be a UINT32, not INT32"),
        (gguf_bytes([(Keys.ALIGNMENT, ValueType.BOOL, True)]), "must be a UINT32, not BOOL"),
        (gguf_bytes([("a", ValueType.ARRAY, (ValueType.ARRAY, []))]), "array of arrays"),
        # an array of arrays claiming 2**62 elements: refused before any element is read
        (_header(0, 1) + gguf_string("a") + struct.pack("<IIQ", 9, 9, 2**62), "array of arrays"),
        (_header(0, 1) + gguf_string("a") + struct.pack("<IIQ", 9, 8, 2**62), "more than the limit"),
        (_header(0, 1) + gguf_string("a") + struct.pack("<IIQ", 9, 4, 2**20), "more than the file can hold"),
        (_header(0, 2**63), "metadata count is 9223372036854775808"),
        (_header(0, 1000), "more than the file can hold"),
        (_header(2**40, 0), "tensor count 1099511627776"),
        (_header(0, 1) + struct.pack("<Q", 2**60) + b"\0" * 16, "truncated"),  # a key longer than the file
        (_header(0, 1) + gguf_string("a") + struct.pack("<I", 99) + b"\0" * 8, "unknown value type 99"),
        (_header(0, 1) + gguf_string(b"\xff\xfe") + struct.pack("<IB", 0, 1) + b"\0" * 8, "not valid UTF-8"),
        (_header(0, 1) + gguf_string("a") + struct.pack("<I", 8) + gguf_string(b"\xc3"), "not valid UTF-8"),
        (_header(0, 1) + gguf_string("a") + struct.pack("<I", 4) + b"\0", "truncated"),
        (gguf_bytes([("a", ValueType.UINT8, 1), ("a", ValueType.UINT8, 2)]), "'a' appears twice"),
        (gguf_bytes([], [("t", [1] * 100, 0, 0)]), "100 dimensions"),
        (gguf_bytes([], [("t", [2**62, 4], 0, 0)]), "more elements than"),
        (gguf_bytes([], [("t", [4], 0, 4096)], data=b"\0" * 16), "runs past the end"),
        (gguf_bytes([], [("t", [4], 0, 3)], data=b"\0" * 32), "not a multiple of the alignment"),
        (gguf_bytes([], [("t", [4], 0, 0), ("t", [4], 0, 32)], data=b"\0" * 64), "'t' appears twice"),
        (gguf_bytes([], [("t" * 64, [4], 0, 0)], data=b"\0" * 16), "64 bytes or longer"),
        (gguf_bytes([], [(b"\x80", [4], 0, 0)], data=b"\0" * 16), "not valid UTF-8"),
        (gguf_bytes(version=2), "version 2 is not supported"),
        (b"GGUF", "too small"),
        (b"", "too small"),
    ],
)
def test_malformed_gguf_headers_are_refused(tmp_path: Path, raw: bytes, words: str) -> None:
    assert words in _gguf_error(tmp_path, raw).message


def test_truncated_gguf_files_are_refused_at_every_cut(tmp_path: Path) -> None:
    from kiln.formats.gguf.reader import read_header

    raw = gguf_bytes(
        [("general.name", ValueType.STRING, "x"), ("a", ValueType.ARRAY, (ValueType.STRING, ["p", "q"]))],
        [("t", [8], TensorType.F32, 0)],
        data=b"\0" * 32,
    )
    (tmp_path / "ok.gguf").write_bytes(raw)
    assert read_header(tmp_path / "ok.gguf").metadata["a"] == ["p", "q"]
    for cut in range(len(raw) - 1, 0, -7):
        path = tmp_path / "cut.gguf"
        path.write_bytes(raw[:cut])
        try:
            read_header(path)
        except InvalidInput as e:
            assert e.code == "GGUF_INVALID"


def test_an_absurd_gguf_is_refused_quickly(tmp_path: Path) -> None:
    """Counts that would take billions of iterations or bytes are refused before the loop."""
    import time

    started = time.monotonic()
    _gguf_error(tmp_path, _header(0, 1) + gguf_string("a") + struct.pack("<IIQ", 9, 8, 2**24 - 1) + b"\0" * 64)
    _gguf_error(tmp_path, _header(2**20, 0) + b"\0" * 1024)
    assert time.monotonic() - started < 2

"""Encoders from float tensors to GGUF tensor bytes: F32, F16, BF16, Q8_0, Q4_0, MXFP4, NVFP4.

Q8_0, Q4_0 and MXFP4 are bit-exact with ggml's reference quantizers (quantize_row_q8_0_ref /
quantize_row_q4_0_ref / quantize_row_mxfp4_ref, as ported to numpy in gguf-py's `gguf.quants`); NVFP4 is
ggml's own quantizer, called in the pinned llama.cpp's library. They are vectorised over
many blocks at once with torch ops on row chunks: every step is an elementwise IEEE float32
operation (no fused multiply-add, exact division), so the bytes match the reference, while torch's
reductions over the 32-wide blocks are several times faster than numpy's along a short last axis.

`Encoder.encode(tensor, ttype)` yields the bytes of one tensor as a sequence of numpy buffers, chunk by
chunk from a thread pool, so a writer can stream them without ever holding the encoded tensor (or a
float32 copy of it) whole.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.core.errors import Deferred
from kiln.formats.gguf.constants import TYPE_TRAITS, TensorType

if TYPE_CHECKING:
    import torch

# Rows are converted in chunks of about this many elements (1 MiB of float32), one chunk per thread
# at a time: big enough that per-op overhead is small, small enough for the temporaries to stay in cache.
CHUNK_ELEMENTS = 1 << 18
MAX_THREADS = 8
# 0.5 rounded down by one ulp: trunc(v + copysign(HALF_DOWN, v)) equals C's roundf(v) for every float32
# |v| <= 2**22, including v = 0.49999997 where adding 0.5 would round up to 1.0.
HALF_DOWN = float(np.nextafter(np.float32(0.5), np.float32(0.0)))


def quantize_q8_0(x: torch.Tensor) -> np.ndarray:
    """Q8_0 of float rows (last dim a multiple of 32): per 32 values an f16 scale and 32 int8."""
    import torch

    rows = x.shape[0] if x.dim() > 1 else 1
    blocks = x.to(torch.float32).reshape(-1, 32)
    # max |x| as max(max x, -min x), without an |x| temporary; "+ 0" turns -0.0 into +0.0 like fabsf
    amax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).add_(0.0)
    d = amax / 127.0
    inv = torch.where(d == 0, 0.0, torch.div(1.0, d))
    v = blocks * inv[:, None]
    v += torch.copysign(torch.tensor(HALF_DOWN), v)  # then float->int truncation: roundf overall
    out = torch.empty((blocks.shape[0], 34), dtype=torch.uint8)
    out[:, :2] = d.to(torch.float16).view(torch.uint8).view(-1, 2)
    out[:, 2:] = v.to(torch.int8).view(torch.uint8)
    return out.numpy().reshape(rows, -1)


def quantize_q4_0(x: torch.Tensor) -> np.ndarray:
    """Q4_0 of float rows (last dim a multiple of 32): an f16 scale and 32 packed 4-bit values."""
    import torch

    rows = x.shape[0] if x.dim() > 1 else 1
    blocks = x.to(torch.float32).reshape(-1, 32)
    # the reference scales by the first value of largest magnitude, sign kept; argmax is slow, so
    # it only settles the blocks where +m and -m both occur (or all values are zero)
    hi, lo = blocks.amax(dim=1), blocks.amin(dim=1)
    vmax = torch.where(hi > -lo, hi, lo)
    tie = torch.nonzero(hi == -lo).squeeze(1)
    if tie.numel():
        sub = blocks[tie]
        vmax[tie] = sub.gather(1, sub.abs().argmax(dim=1, keepdim=True)).squeeze(1)
    d = vmax / -8.0
    inv = torch.where(d == 0, 0.0, torch.div(1.0, d))
    v = blocks * inv[:, None]
    v += 8.5
    q = v.to(torch.uint8).clamp_(max=15)  # v >= 0 here, so the cast is trunc
    out = torch.empty((blocks.shape[0], 18), dtype=torch.uint8)
    out[:, :2] = d.to(torch.float16).view(torch.uint8).view(-1, 2)
    torch.bitwise_or(q[:, :16], q[:, 16:] << 4, out=out[:, 2:])
    return out.numpy().reshape(rows, -1)


# OCP MX E2M1 values, doubled (ggml's kvalues_mxfp4): index i of a nibble is the value kvalues[i] * d / 2.
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def quantize_mxfp4(x: torch.Tensor) -> np.ndarray:
    """MXFP4 of float rows (last dim a multiple of 32): an E8M0 exponent and 32 packed E2M1 nibbles.

    ggml's quantize_row_mxfp4_ref: e = floor(log2(max |x|)) - 2 + 127 (0 for an all-zero block), the
    half-scale d = 2^(e - 128) (`ggml_e8m0_to_fp32_half`), and each value the nibble whose doubled E2M1 value
    times d is nearest (the first on a tie); value j and j + 16 share byte j."""
    import torch

    rows = x.shape[0] if x.dim() > 1 else 1
    blocks = x.to(torch.float32).reshape(-1, 32)
    amax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).add_(0.0)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, 0.0).to(torch.int32)
    # 2^(e - 128) as float32 bits: subnormal for e < 2 (0x00200000 << e), else the exponent field e - 1
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    values = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
    err = (d[:, None, None] * values - blocks[:, :, None]).abs_()
    q = err.argmin(dim=2).to(torch.uint8)  # the first minimum, as the reference's strict `<`
    out = torch.empty((blocks.shape[0], 17), dtype=torch.uint8)
    out[:, 0] = e.to(torch.uint8)
    torch.bitwise_or(q[:, :16], q[:, 16:] << 4, out=out[:, 1:])
    return out.numpy().reshape(rows, -1)


def mxfp4_from_ocp(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 blocks as a release stores them (OCP MX, gpt-oss: `blocks` uint8 [..., groups, 16], value 2k of a
    block in byte k's low nibble and 2k + 1 in its high one; `scales` uint8 [..., groups], E8M0 exponents) as
    ggml's block_mxfp4 rows, uint8 [..., groups x 17]: each block's exponent byte, then byte j holding value j in
    its low nibble and value j + 16 in its high one.

    Only bits move: a nibble is the same code in both (ggml's `kvalues_mxfp4` are OCP's E2M1 values doubled, and
    ggml halves the exponent's power of two: `GGML_E8M0_TO_FP32_HALF`), and the exponent byte is the same byte.
    llama.cpp's converter does the same (conversion/gpt_oss.py `transform_nibble_layout`, base.py
    `repack_mxfp4_blocks`)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks must be uint8 [..., 16], got {blocks.dtype} {list(blocks.shape)}")
    if scales.shape != blocks.shape[:-1]:
        raise ValueError(f"MXFP4 scales {list(scales.shape)} do not match blocks {list(blocks.shape)}")
    values = np.stack((blocks & 0x0F, blocks >> 4), axis=-1).reshape(*blocks.shape[:-1], 32)
    out = np.empty((*blocks.shape[:-1], 17), dtype=np.uint8)
    out[..., 0] = scales
    np.bitwise_or(values[..., :16], values[..., 16:] << 4, out=out[..., 1:])
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 17)


def quantize_nvfp4(x: torch.Tensor) -> np.ndarray:
    """NVFP4 of float rows (last dim a multiple of 64), as llama.cpp stores it: per 16 values an unsigned E4M3
    scale and 16 E2M1 nibbles, four such groups to a 36-byte block. Encoded by ggml's own reference quantizer
    (`ggml_quantize_chunk` in the pinned llama.cpp's libggml, which its CPU kernels are written against)."""
    import torch

    quantize = _ggml_quantize_chunk()
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous().numpy()
    traits = TYPE_TRAITS[TensorType.NVFP4]
    out = np.empty((rows.shape[0], rows.shape[1] // traits.block_size * traits.type_size), dtype=np.uint8)
    written = quantize(int(TensorType.NVFP4), rows.ctypes.data, out.ctypes.data, 0, rows.shape[0], rows.shape[1], None)
    if written != out.nbytes:
        raise ValueError(f"ggml wrote {written} bytes of NVFP4 for {out.nbytes}")
    return out


def _ggml_quantize_chunk() -> Any:
    """ggml's `size_t ggml_quantize_chunk(type, const float *src, void *dst, start, nrows, n_per_row, imatrix)`
    from llama-cpp-python's libggml; Deferred where llama-cpp-python is not installed."""
    global _QUANTIZE_CHUNK
    if _QUANTIZE_CHUNK is None:
        import ctypes

        try:
            from llama_cpp import _ggml
        except ImportError as e:  # pragma: no cover - depends on the install
            raise Deferred(
                f"GGUF NVFP4 is encoded by llama.cpp's quantizer (llama-cpp-python), not installed here: {e}",
                details={"needs": "llama-cpp-python>=0.3"},
            ) from None
        fn = _ggml.libggml.ggml_quantize_chunk
        fn.restype = ctypes.c_size_t
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
        _QUANTIZE_CHUNK = fn
    return _QUANTIZE_CHUNK


_QUANTIZE_CHUNK: Any = None

QUANTIZERS: dict[TensorType, Callable[[torch.Tensor], np.ndarray]] = {
    TensorType.Q8_0: quantize_q8_0,
    TensorType.Q4_0: quantize_q4_0,
    TensorType.MXFP4: quantize_mxfp4,
    TensorType.NVFP4: quantize_nvfp4,
}


class Encoder:
    """Encodes tensors to GGUF bytes in row chunks on a thread pool that lives as long as the encoder.

    Chunks are converted in order with at most two per thread in flight, so memory stays at the source
    tensor plus a few chunks, and the caller writes one chunk while the pool converts the next ones.
    While the encoder is open, torch runs single-threaded in the calling thread and in each worker:
    the pool is the parallelism, and torch's own OpenMP workers, spinning between the small ops,
    would otherwise starve the writer and the other chunks (measured: 10x slower on 2 cores).
    """

    def __init__(self, threads: int | None = None) -> None:
        import torch

        self.threads = threads if threads is not None else worker_count()
        self._prev_torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            self.threads, thread_name_prefix="kiln-gguf", initializer=_single_threaded_torch
        )

    def encode(self, tensor: torch.Tensor, ttype: TensorType) -> Iterator[np.ndarray]:
        """Yield the GGUF bytes of `tensor` (F32/F16/BF16, any layout) as `ttype`, in row chunks."""
        if ttype in QUANTIZERS:
            block = TYPE_TRAITS[ttype].block_size
            if tensor.shape[-1] % block:
                raise ValueError(
                    f"row length {tensor.shape[-1]} is not a multiple of the {ttype.name} block size {block}"
                )
        convert = _CONVERTERS.get(ttype) or QUANTIZERS.get(ttype)
        if convert is None:
            raise ValueError(f"kiln does not encode {ttype.name} itself")
        ne0 = tensor.shape[-1]
        rows = tensor.reshape(-1, ne0)
        step = max(1, CHUNK_ELEMENTS // ne0)
        starts = range(0, rows.shape[0], step)
        if self._pool is None:
            raise ValueError("the encoder is closed")
        if len(starts) == 1:  # one small chunk: not worth a hand-off
            yield convert(rows)
            return
        pending: deque[Future[np.ndarray]] = deque()
        try:
            for r in starts:
                pending.append(self._pool.submit(convert, rows[r : r + step]))
                if len(pending) >= 2 * self.threads:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()

    def close(self) -> None:
        import torch

        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
            torch.set_num_threads(self._prev_torch_threads)

    def __enter__(self) -> Encoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def encode(tensor: torch.Tensor, ttype: TensorType) -> Iterator[np.ndarray]:
    """`Encoder().encode` for one tensor."""
    with Encoder() as enc:
        yield from enc.encode(tensor, ttype)


def _as_f32(x: torch.Tensor) -> np.ndarray:
    import torch

    return x.to(torch.float32).contiguous().numpy()


class F16Overflow(ValueError):
    """A finite source value is outside float16's range (|x| > 65504) and would become inf."""


def _as_f16(x: torch.Tensor) -> np.ndarray:
    import torch

    # via float32: torch's bf16 -> f32 and f32 -> f16 casts are vectorised, its direct bf16 -> f16 is ~5x slower
    f = x.to(torch.float32)
    # |x| >= 65520 rounds to inf in float16 (the largest finite half is 65504)
    suspect = float(f.amax()) >= 65520.0 or float(f.amin()) <= -65520.0  # cheap; exact check only if needed
    if suspect and bool(((f.abs() >= 65520.0) & torch.isfinite(f)).any()):
        raise F16Overflow(f"a value of magnitude {float(f.abs().max()):.6g} does not fit in float16 (max 65504)")
    return f.to(torch.float16).numpy()


def _as_bf16(x: torch.Tensor) -> np.ndarray:
    import torch

    # numpy has no bfloat16: hand over the raw bits
    return x.to(torch.bfloat16).contiguous().view(torch.int16).numpy()


_CONVERTERS: dict[TensorType, Callable[[torch.Tensor], np.ndarray]] = {
    TensorType.F32: _as_f32,
    TensorType.F16: _as_f16,
    TensorType.BF16: _as_bf16,
}


def worker_count() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_THREADS, cpus))


def _single_threaded_torch() -> None:
    import torch

    # OpenMP's thread count is per calling thread: this worker runs each op inline instead of
    # handing it to torch's pool, whose spinning workers would fight the other chunk threads.
    torch.set_num_threads(1)

"""The `gguf` target: a SafeTensors Llama-family release -> one GGUF v3 file llama.cpp loads.

F16, BF16, Q8_0, Q4_0, MXFP4 and NVFP4 are written by kiln in one streaming pass (NVFP4 encoded by
ggml's quantizer). Q4_K_M and Q6_K are produced by llama.cpp's own quantizer (`llama_model_quantize`
through llama-cpp-python) from a lossless intermediate GGUF that kiln writes first and removes
afterwards, so their per-tensor type mix is exactly llama-quantize's.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import Deferred, InvalidInput, StageFailed, UnknownName
from formats.gguf.constants import (
    GGML_QUANT_VERSION,
    QK_K,
    QUANTS,
    RUNTIME,
    FileType,
    Keys,
    QuantSpec,
    TensorType,
)
from formats.gguf.reader import read_header
from formats.gguf.writer import GGUFWriter, Metadata

from .convert import TensorPlan, arch_spec, convert_tensors, plan_tensors
from .tokenizer import VocabMetadata, predict_vocab, read_vocab

if TYPE_CHECKING:
    import torch

    from formats.hf_model import SourceModel
    from targets.base import ExportRequest, ExportResult

_LOSSLESS_FILE_TYPES = {TensorType.BF16: FileType.MOSTLY_BF16, TensorType.F16: FileType.MOSTLY_F16}


def output_name(quant: str) -> str:
    return f"model-{quant}.gguf"


def check_supported(source: SourceModel) -> None:
    """Refuse model features llama.cpp's llama/qwen2 graphs would silently compute differently."""
    cfg = source.config
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise InvalidInput(
            f"GGUF export: hidden_act={act!r} is not supported (llama.cpp uses SiLU)", code="GGUF_UNSUPPORTED"
        )
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in (None, "default"):
        raise InvalidInput(
            f"GGUF export: rope scaling {rope_type!r} is not supported yet (only plain rope)",
            code="GGUF_UNSUPPORTED",
            details={"rope_type": rope_type},
        )
    if cfg.get("use_sliding_window"):
        raise InvalidInput("GGUF export: sliding-window attention is not supported", code="GGUF_UNSUPPORTED")
    arch_spec(source.shape)


def model_metadata(meta: Metadata, source: SourceModel, name: str, file_type: FileType) -> None:
    """The general.* and {arch}.* keys llama.cpp reads for the llama / qwen2 architectures."""
    s = source.shape
    arch = arch_spec(s).gguf_arch

    def k(key: str) -> str:
        return key.format(arch=arch)

    meta.add_string(Keys.ARCHITECTURE, arch)
    meta.add_string(Keys.NAME, name)
    meta.add_uint32(k(Keys.CONTEXT_LENGTH), s.max_position_embeddings)
    meta.add_uint32(k(Keys.EMBEDDING_LENGTH), s.hidden_size)
    meta.add_uint32(k(Keys.BLOCK_COUNT), s.num_layers)
    meta.add_uint32(k(Keys.FEED_FORWARD_LENGTH), s.intermediate_size)
    meta.add_uint32(k(Keys.HEAD_COUNT), s.num_heads)
    meta.add_uint32(k(Keys.HEAD_COUNT_KV), s.num_kv_heads)
    meta.add_float32(k(Keys.ROPE_FREQ_BASE), s.rope_theta)
    meta.add_float32(k(Keys.LAYERNORM_RMS_EPS), s.rms_norm_eps)
    meta.add_uint32(k(Keys.ROPE_DIMENSION_COUNT), s.head_dim)
    if s.head_dim != s.hidden_size // s.num_heads:
        meta.add_uint32(k(Keys.KEY_LENGTH), s.head_dim)
        meta.add_uint32(k(Keys.VALUE_LENGTH), s.head_dim)
    meta.add_uint32(k(Keys.VOCAB_SIZE), s.vocab_size)
    meta.add_uint32(Keys.FILE_TYPE, file_type)
    meta.add_uint32(Keys.QUANTIZATION_VERSION, GGML_QUANT_VERSION)


@dataclass(frozen=True)
class TokenizerSource:
    """Tokenizer metadata to write: a fast prediction (None if the files alone are not enough) and the
    reference, which may take seconds to load (transformers) and is awaited only when needed."""

    predicted: VocabMetadata | None
    reference: Callable[[], VocabMetadata]


def write_gguf(
    source: SourceModel,
    plans: list[TensorPlan],
    path: Path,
    tokenizer: TokenizerSource,
    *,
    name: str,
    file_type: FileType,
    on_progress: Callable[[int], None] = lambda n: None,
) -> tuple[VocabMetadata, str]:
    """Plan the whole file from the source header, then stream every tensor into it, one at a time.

    The weights are streamed while the reference tokenizer loads; the header is written with the
    predicted tokenizer metadata and corrected at the end if the reference disagrees. Returns the
    tokenizer metadata written and how the header was settled.
    """
    from formats.gguf.quants import Encoder, F16Overflow

    def metadata(vocab: VocabMetadata) -> Metadata:
        meta = Metadata()
        model_metadata(meta, source, name, file_type)
        vocab.add_to(meta)
        return meta

    vocab = tokenizer.predicted if tokenizer.predicted is not None else tokenizer.reference()
    with GGUFWriter(path) as writer, Encoder() as encoder:
        writer.add_metadata(metadata(vocab))
        for p in plans:
            writer.plan_tensor(p.name, p.shape, p.ttype)
        writer.begin()
        converted = convert_tensors(_source_tensors(source, plans), source.shape)
        for plan, (gname, tensor) in zip(plans, converted, strict=True):
            try:
                writer.write_tensor(gname, encoder.encode(tensor, plan.ttype))
            except F16Overflow as e:
                raise InvalidInput(
                    f"GGUF: tensor {plan.source!r} cannot be stored as F16: {e}; export bf16 (or q8_0) instead",
                    code="GGUF_F16_OVERFLOW",
                    details={"tensor": plan.source},
                ) from None
            on_progress(plan.source_nbytes)
        reference = tokenizer.reference()
        settled = "as predicted"
        if reference != vocab:
            in_place = writer.rewrite_metadata(metadata(reference))
            settled = "rewritten in place" if in_place else "rewritten, weights moved"
        writer.finish()
    return reference, settled


def _source_tensors(source: SourceModel, plans: list[TensorPlan]) -> Iterator[tuple[str, torch.Tensor]]:
    for p in plans:
        yield p.source, source.tensor(p.source)


def llama_quantize(src: Path, dst: Path, ftype: FileType, *, threads: int = 0) -> None:
    """Run llama.cpp's quantizer (llama-quantize's library call) from `src` into `dst`."""
    try:
        import llama_cpp
        from llama_cpp import _logger as llama_logger
    except ImportError as e:  # pragma: no cover - depends on the install
        raise Deferred(
            f"GGUF {ftype.name} needs llama-cpp-python (llama.cpp's quantizer), which is not installed here: {e}",
            details={"needs": "llama-cpp-python>=0.3"},
        ) from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(ftype)
    params.nthread = threads
    level = llama_logger.logger.level
    llama_logger.logger.setLevel(logging.ERROR)  # the quantizer logs every tensor otherwise
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    finally:
        llama_logger.logger.setLevel(level)
    if rc != 0 or not dst.is_file():
        dst.unlink(missing_ok=True)
        raise StageFailed(f"llama.cpp's quantizer failed ({ftype.name}, rc={rc})", code="GGUF_QUANTIZE_FAILED")


def prepare(source: SourceModel) -> dict[str, Any]:
    """Once per source, for every GGUF export: the tokenizer as transformers loads it (the reference
    metadata; loading transformers costs seconds a bare tensor conversion does not)."""
    check_supported(source)
    return {"vocab": asdict(read_vocab(source.root, source.shape.vocab_size, source.config))}


def export(source: SourceModel, req: ExportRequest) -> ExportResult:
    """Write `model-<quant>.gguf` into `req.out_dir`.

    `req.params`: `name` (general.name, default: the recipe's model name), `strict_types` (raise
    GGUF_ROW_NOT_DIVISIBLE instead of falling back when a row does not fill whole quant blocks).
    """
    from targets.base import ExportResult

    quant = QUANTS.get(req.quant)
    if quant is None:
        raise UnknownName(
            f"GGUF: unknown quant {req.quant!r}; known: {', '.join(QUANTS)}", details={"known": list(QUANTS)}
        )
    strict = bool(req.params.get("strict_types", False))
    name = str(req.params.get("name") or req.model_name or source.root.name)
    check_supported(source)
    plans = plan_tensors(source.tensors, source.shape, quant, strict=strict)
    expected_fallbacks = _k_quant_fallbacks(plans, quant, strict)

    out_dir = Path(req.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / output_name(quant.name)
    with ThreadPoolExecutor(1, thread_name_prefix="kiln-gguf-tokenizer") as pool:
        shape, root = source.shape, source.root
        predicted: VocabMetadata | None
        if req.prepared is not None:  # the prepare stage read the reference once for every export
            prepared = VocabMetadata(**req.prepared["vocab"])
            tokenizer = TokenizerSource(prepared, lambda: prepared)
        else:
            reference = pool.submit(read_vocab, root, shape.vocab_size, source.config)
            try:
                predicted = predict_vocab(root, shape.vocab_size, source.config)
            except InvalidInput:
                predicted = None  # the reference decides: it may load fine, or it raises the error to report
            tokenizer = TokenizerSource(predicted, reference.result)
        if quant.llama_ftype is None:
            vocab, settled = write_gguf(
                source, plans, final, tokenizer, name=name, file_type=quant.file_type, on_progress=req.on_progress
            )
            fallbacks = {p.name: p.fallback for p in plans if p.fallback}
            types = Counter(p.ttype.name for p in plans)
        else:
            intermediate = out_dir / f".{final.stem}.lossless.gguf"
            lossless = Counter(p.ttype for p in plans if len(p.shape) > 1).most_common(1)[0][0]
            try:
                vocab, settled = write_gguf(
                    source,
                    plans,
                    intermediate,
                    tokenizer,
                    name=name,
                    file_type=_LOSSLESS_FILE_TYPES.get(lossless, FileType.ALL_F32),
                    on_progress=req.on_progress,
                )
                llama_quantize(intermediate, final, quant.llama_ftype)
            except BaseException:
                final.unlink(missing_ok=True)
                raise
            finally:
                intermediate.unlink(missing_ok=True)
            written = read_header(final).tensor_types()
            types = Counter(written.values())
            fallbacks = {g: f"{why}; llama.cpp wrote {written.get(g, '?')}" for g, why in expected_fallbacks.items()}
    details: dict[str, Any] = {
        "architecture": arch_spec(source.shape).gguf_arch,
        "permuted_qk": arch_spec(source.shape).permute_qk,
        "tokenizer_pre": vocab.pre,
        "tokenizer_header": settled,
        "vocab_padded": vocab.padded,
        "add_bos": vocab.add_bos,
        "tensor_types": dict(sorted(types.items())),
    }
    if quant.llama_ftype is not None:
        details["quantizer"] = "llama.cpp llama_model_quantize"
    if vocab.notes:
        details["notes"] = vocab.notes
    if fallbacks:
        details["fallbacks"] = fallbacks
    return ExportResult(files=[final.name], runtime=dict(RUNTIME), details=details)


def _k_quant_fallbacks(plans: list[TensorPlan], quant: QuantSpec, strict: bool) -> dict[str, str]:
    """For K-quants: the 2-D tensors whose rows are not whole 256-value super-blocks, for which
    llama.cpp's quantizer picks a fallback type itself (or, with `strict`, the error)."""
    if quant.llama_ftype is None:
        return {}
    out: dict[str, str] = {}
    for p in plans:
        if len(p.shape) > 1 and p.shape[-1] % QK_K:
            reason = f"row length {p.shape[-1]} is not a multiple of the K-quant block size {QK_K}"
            if strict:
                raise InvalidInput(
                    f"GGUF {quant.name}: tensor {p.source!r} ({p.name}) cannot be stored as a K-quant: {reason}",
                    code="GGUF_ROW_NOT_DIVISIBLE",
                    details={"tensor": p.source, "gguf_tensor": p.name, "row_length": p.shape[-1]},
                )
            out[p.name] = reason
    return out

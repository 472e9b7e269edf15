"""Lint a GGUF file as llama.cpp loads it: the header, the keys its architecture reads, every tensor the keys
imply, and the block scales of the types whose scale is a plain float.

- The header is `formats.gguf.reader.read_header`'s (gguf.cpp's own rules: GGUF_HEADER when refused).
- The model: the family whose record maps to the file's `general.architecture` gives the tensors a layer
  holds (`ModelShape.tensors()`, named by kind as llama.cpp names them, experts stacked); the sizes come from
  the source's config when the lint is given it (the export stage), else from the file's own keys. Then
  every key is checked against the tensors (`block_count` against the `blk.N` present, `expert_count`
  against the stacked experts, `embedding_length` against `token_embd`) and, with the source's config,
  against it: sliding window and pattern, rope base / dimensions / scaling, experts and their count.
- Block scales: the f16 `d` of Q4_0 / Q5_0 / Q8_0, `d` and `dmin` of Q4_K / Q5_K, `d` of Q6_K, the UE4M3
  sub-block scales of NVFP4 (ggml-common.h `block_*`), read in chunks of a tensor's blocks: NaN or infinite
  ones are errors. llama.cpp writes d = 0 for an all-zero block, so zero is an error only when every block of
  a tensor has it (the tensor is all zeros). MXFP4's E8M0 exponents have no NaN in ggml's decoding. The
  fields lie in every block, so the whole tensor is read, 16 MiB at a time.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from kiln.core.errors import KilnError
from kiln.formats.architectures import FAMILIES
from kiln.formats.architectures.config import MlaShape, MoeShape
from kiln.formats.architectures.record import Architecture
from kiln.formats.architectures.shape import ModelShape
from kiln.formats.gguf.constants import QUANTS, TYPE_TRAITS, FileType, Keys, TensorType
from kiln.formats.gguf.layout import FLOAT_FILE_TYPES, gguf_file_type
from kiln.formats.gguf.reader import GGUFHeader, TensorEntry, read_header
from kiln.targets.gguf.convert import layout, llama_cpp_arch
from kiln.targets.gguf.export import rope_dimensions
from kiln.targets.lint.findings import Finding, LintReport, LintRequest, finding
from kiln.targets.lint.values import ScaleCounts

if TYPE_CHECKING:
    import numpy as np

# llama.cpp's keys (src/llama-arch.cpp, LLM_KV_NAMES) the lint reads beyond `formats.gguf.constants.Keys`.
EXPERT_COUNT: Final = "{arch}.expert_count"
EXPERT_USED_COUNT: Final = "{arch}.expert_used_count"
EXPERT_FF: Final = "{arch}.expert_feed_forward_length"
EXPERT_SHARED_FF: Final = "{arch}.expert_shared_feed_forward_length"
SLIDING_WINDOW: Final = "{arch}.attention.sliding_window"
SLIDING_PATTERN: Final = "{arch}.attention.sliding_window_pattern"
ROPE_BASE_SWA: Final = "{arch}.rope.freq_base_swa"
ROPE_SCALING_TYPE: Final = "{arch}.rope.scaling.type"
ROPE_SCALING_FACTOR: Final = "{arch}.rope.scaling.factor"
UNQUANTIZED: Final = frozenset({TensorType.F32, TensorType.F16, TensorType.BF16})
# Byte offsets of a block's f16 scale fields (the first is `d`, which a non-zero block has non-zero).
F16_SCALES: Final[dict[TensorType, tuple[int, ...]]] = {
    TensorType.Q4_0: (0,),
    TensorType.Q5_0: (0,),
    TensorType.Q8_0: (0,),
    TensorType.Q4_K: (0, 2),
    TensorType.Q5_K: (0, 2),
    TensorType.Q6_K: (208,),
}
NVFP4_SCALES: Final = 4  # block_nvfp4: d[4] (UE4M3, one per 16 values), then qs[32]
CHUNK_BYTES: Final = 16 << 20
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def lint_gguf_dir(req: LintRequest) -> LintReport:
    """Lint every .gguf file of `req.root` (a gguf artifact holds one)."""
    files = sorted(req.root.glob("*.gguf")) if req.root.is_dir() else [req.root]
    report = LintReport(str(req.root), "gguf-v3")
    if not files:
        report.add(finding("FILE_MISSING", "*.gguf", "a GGUF artifact holds one .gguf file", None))
    for path in files:
        lint_file(path, req, report)
    return report


@dataclass(frozen=True)
class _Keys:
    """The file's metadata with `{arch}` filled in."""

    arch: str
    meta: dict[str, Any]

    def key(self, template: str) -> str:
        return template.format(arch=self.arch)

    def get(self, template: str) -> Any:
        return self.meta.get(self.key(template))


def lint_file(path: Path, req: LintRequest, report: LintReport) -> None:
    file = path.name
    try:
        header = read_header(path)
    except KilnError as e:
        report.add(finding("GGUF_HEADER", file, e.message.removeprefix(f"{path}: "), file))
        return
    tensors = {t.name: t for t in header.tensors}
    report.tensors += len(tensors)
    arch = header.metadata.get(Keys.ARCHITECTURE)
    if not isinstance(arch, str):
        report.add(finding("GGUF_KEY_MISSING", Keys.ARCHITECTURE, "llama.cpp picks the model's graph by it", file))
        return
    keys = _Keys(arch, header.metadata)
    report.extend(_check_types(header, keys, file, req.quant, req.shape))
    shape, found = _shape_from_keys(keys, tensors, file)
    report.extend(found)
    if shape is not None:
        report.extend(_check_keys_against_tensors(keys, shape, tensors, file))
    if req.shape is not None:
        report.extend(_check_keys_against_config(keys, req.shape, tensors, file))
    family = _family(arch)
    model = req.shape if req.shape is not None else shape
    if family is not None and model is not None and model.family in _families_of(arch):
        report.extend(_check_tensors(model, family, tensors, file, source=req.shape is not None))
    _check_block_scales(path, header, report)


def _families_of(arch: str) -> set[str]:
    return {f for f, a in FAMILIES.items() if a.target("gguf").gguf_arch == arch}


def _family(arch: str) -> Architecture | None:
    """The first record mapping to llama.cpp's `arch` (llama and mistral share `llama`: the same tensors)."""
    return next((a for a in FAMILIES.values() if a.target("gguf").gguf_arch == arch), None)


def _check_types(
    header: GGUFHeader, keys: _Keys, file: str, quant: str | None, source: ModelShape | None
) -> list[Finding]:
    out = []
    quantized = False
    mxfp4 = False
    for t in header.tensors:
        try:
            ttype = TensorType(t.type_id)
        except ValueError:
            out.append(finding("GGUF_TYPE_UNCHECKED", t.name, f"type id {t.type_id}: its scales are not read", file))
            continue
        quantized |= ttype not in UNQUANTIZED
        mxfp4 |= ttype is TensorType.MXFP4
        block = TYPE_TRAITS[ttype].block_size
        if t.shape and t.shape[-1] % block:
            msg = f"rows of {t.shape[-1]} values do not fill whole {ttype.name} blocks of {block}"
            out.append(finding("TENSOR_SHAPE", t.name, msg, file))
    if quantized and not isinstance(header.metadata.get(Keys.QUANTIZATION_VERSION), int):
        msg = "a file with quantized tensors must say its quantization version (llama.cpp refuses it otherwise)"
        out.append(finding("GGUF_KEY_MISSING", Keys.QUANTIZATION_VERSION, msg, file))
    spec = QUANTS.get(quant or "")
    if spec is None:
        return out
    # A float file that keeps a release's MXFP4 experts is llama.cpp's "MXFP4 MoE" (`gguf_file_type`); without
    # the source, its MXFP4 tensors say so.
    if source is not None:
        want = gguf_file_type(source, spec)
    else:
        want = FileType.MOSTLY_MXFP4_MOE if mxfp4 and spec.file_type in FLOAT_FILE_TYPES else spec.file_type
    if header.metadata.get(Keys.FILE_TYPE) != int(want):
        msg = f"is {header.metadata.get(Keys.FILE_TYPE)!r}; {quant} is {want.name} ({int(want)})"
        out.append(finding("CONFIG_MISMATCH", Keys.FILE_TYPE, msg, file))
    return out


def _uint(keys: _Keys, template: str, file: str, out: list[Finding], *, required: bool = True) -> int | None:
    value = keys.get(template)
    if value is None:
        if required:
            out.append(finding("GGUF_KEY_MISSING", keys.key(template), f"llama.cpp's {keys.arch} reads it", file))
        return None
    if type(value) is not int or value < 0:
        out.append(
            finding("GGUF_KEY_MISSING", keys.key(template), f"must be an unsigned integer, got {value!r:.60}", file)
        )
        return None
    return value


def _shape_from_keys(
    keys: _Keys, tensors: dict[str, TensorEntry], file: str
) -> tuple[ModelShape | None, list[Finding]]:
    """The model the file's keys describe, as a `ModelShape` of the family mapped to its architecture (None
    where the family is unknown or a required key is absent)."""
    out: list[Finding] = []
    layers = _uint(keys, Keys.BLOCK_COUNT, file, out)
    hidden = _uint(keys, Keys.EMBEDDING_LENGTH, file, out)
    heads = _uint(keys, Keys.HEAD_COUNT, file, out)
    context = _uint(keys, Keys.CONTEXT_LENGTH, file, out)
    ff = _uint(keys, Keys.FEED_FORWARD_LENGTH, file, out, required=False)
    kv_heads = _uint(keys, Keys.HEAD_COUNT_KV, file, out, required=False)
    key_length = _uint(keys, Keys.KEY_LENGTH, file, out, required=False)
    experts = _uint(keys, EXPERT_COUNT, file, out, required=False)
    family = _family(keys.arch)
    if family is None or None in (layers, hidden, heads, context) or not heads:
        return None, out
    assert layers is not None and hidden is not None and heads is not None and context is not None
    embd = tensors.get("token_embd.weight")
    vocab = embd.shape[0] if embd is not None and len(embd.shape) == 2 else len(keys.meta.get(Keys.TOKENS) or [])
    moe = None
    mla = _mla_from_keys(keys, file, out)
    if experts:
        sparse = tuple(sorted({int(m.group(1)) for n in tensors if (m := _BLOCK.match(n)) and ".ffn_gate_inp." in n}))
        expert_ff = keys.get(EXPERT_FF) or ff or 0
        shared = keys.get(EXPERT_SHARED_FF) or (keys.get(Keys.EXPERT_SHARED_COUNT) or 0) * expert_ff
        moe = MoeShape(
            experts=experts,
            experts_per_token=keys.get(EXPERT_USED_COUNT) or 0,
            intermediate_size=expert_ff,
            norm_topk_prob=False,
            sparse_layers=sparse,
            shared_intermediate_size=shared,
        )
    window = keys.get(SLIDING_WINDOW) or None
    shape = ModelShape(
        architecture=family.hf_class,
        family=family.family,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ff or 0,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads if mla is not None else kv_heads or heads,
        head_dim=mla.qk_head_dim if mla is not None else key_length or hidden // heads,
        rope_theta=float(keys.get(Keys.ROPE_FREQ_BASE) or 10000.0),
        rms_norm_eps=float(keys.get(Keys.LAYERNORM_RMS_EPS) or 1e-6),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        bos_token_id=None,
        eos_token_id=None,
        layer_types=_pattern(keys, layers) or (),
        sliding_window=window,
        moe=moe,
        mla=mla,
    )
    return shape, out


def _mla_from_keys(keys: _Keys, file: str, out: list[Finding]) -> MlaShape | None:
    """deepseek2's latent attention from its keys (`attention.kv_lora_rank` present), each head's no-rope part the
    decompressed key length less the rope's dimensions; None for a file without it."""
    kv_lora = _uint(keys, Keys.KV_LORA_RANK, file, out, required=False)
    if kv_lora is None:
        return None
    q_lora = _uint(keys, Keys.Q_LORA_RANK, file, out, required=False)
    key_mla = _uint(keys, Keys.KEY_LENGTH_MLA, file, out)
    value_mla = _uint(keys, Keys.VALUE_LENGTH_MLA, file, out)
    rope = _uint(keys, Keys.ROPE_DIMENSION_COUNT, file, out)
    if key_mla is None or value_mla is None or rope is None or not 0 < rope < key_mla:
        return None
    return MlaShape(q_lora or None, kv_lora, key_mla - rope, rope, value_mla)


def _pattern(keys: _Keys, layers: int) -> tuple[Any, ...] | None:
    """Each layer's attention kind from `sliding_window_pattern` (an array of bools, true: sliding; or a period
    n: every n-th layer full, as llama.cpp's `set_swa_pattern`), None where the file has none."""
    p = keys.get(SLIDING_PATTERN)
    if isinstance(p, list):
        return tuple("sliding_attention" if v else "full_attention" for v in p)
    if type(p) is int and p > 0:
        return tuple("sliding_attention" if (i + 1) % p else "full_attention" for i in range(layers))
    return None


def _check_keys_against_tensors(
    keys: _Keys, shape: ModelShape, tensors: dict[str, TensorEntry], file: str
) -> list[Finding]:
    """The keys the file states against the tensors it holds."""
    out = []
    blocks = {int(m.group(1)) for n in tensors if (m := _BLOCK.match(n))}
    if blocks != set(range(shape.num_layers)):
        extra, missing = sorted(blocks - set(range(shape.num_layers))), sorted(set(range(shape.num_layers)) - blocks)
        msg = f"is {shape.num_layers}, the tensors hold blocks {_ranges(sorted(blocks))}"
        msg += f" (extra {extra[:4]})" if extra else f" (missing {missing[:4]})"
        out.append(finding("CONFIG_MISMATCH", keys.key(Keys.BLOCK_COUNT), msg, file))
    embd = tensors.get("token_embd.weight")
    if embd is not None and len(embd.shape) == 2 and embd.shape[1] != shape.hidden_size:
        msg = f"is {shape.hidden_size}, token_embd.weight rows are {embd.shape[1]} long"
        out.append(finding("CONFIG_MISMATCH", keys.key(Keys.EMBEDDING_LENGTH), msg, file))
    for key in (keys.key(Keys.VOCAB_SIZE),):
        value = keys.meta.get(key)
        if value is not None and embd is not None and value != embd.shape[0]:
            out.append(finding("CONFIG_MISMATCH", key, f"is {value}, token_embd.weight has {embd.shape[0]} rows", file))
    tokens = keys.meta.get(Keys.TOKENS)
    if isinstance(tokens, list) and embd is not None and len(tokens) > embd.shape[0]:
        msg = f"lists {len(tokens)} tokens, token_embd.weight has {embd.shape[0]} rows"
        out.append(finding("CONFIG_MISMATCH", Keys.TOKENS, msg, file))
    stacked = {n: t.shape for n, t in tensors.items() if n.endswith(("_exps.weight", ".ffn_gate_inp.weight"))}
    experts = shape.moe.experts if shape.moe is not None else 0
    for n, dims in stacked.items():
        count_ = dims[0] if n.endswith("_exps.weight") else dims[0] if len(dims) == 2 else None
        if count_ is not None and count_ != experts:
            say = f"is {experts}" if experts else "is absent"
            msg = f"{say}, {n} holds {count_} experts"
            out.append(finding("CONFIG_EXPERTS", keys.key(EXPERT_COUNT), msg, file))
            break
    if shape.moe is not None and not 0 < shape.moe.experts_per_token <= shape.moe.experts:
        msg = f"is {shape.moe.experts_per_token}; it must be 1..{shape.moe.experts} (expert_count)"
        out.append(finding("CONFIG_EXPERTS", keys.key(EXPERT_USED_COUNT), msg, file))
    pattern = keys.get(SLIDING_PATTERN)
    if isinstance(pattern, list) and len(pattern) != shape.num_layers:
        msg = f"has {len(pattern)} entries for block_count {shape.num_layers}"
        out.append(finding("CONFIG_LAYER_TYPES", keys.key(SLIDING_PATTERN), msg, file))
    if "sliding_attention" in shape.layer_types and not shape.sliding_window:
        msg = "is absent or 0 while sliding_window_pattern makes layers slide"
        out.append(finding("CONFIG_SLIDING_WINDOW", keys.key(SLIDING_WINDOW), msg, file))
    dims_ = keys.get(Keys.ROPE_DIMENSION_COUNT)
    if type(dims_) is int and (dims_ > shape.head_dim or dims_ % 2):
        msg = f"is {dims_}; rope rotates an even number of a head's {shape.head_dim} dimensions"
        out.append(finding("CONFIG_ROPE", keys.key(Keys.ROPE_DIMENSION_COUNT), msg, file))
    return out


def _close(a: Any, b: float) -> bool:
    """float32 keys against a config's float: equal to float32 precision."""
    return isinstance(a, int | float) and math.isclose(float(a), b, rel_tol=1e-6, abs_tol=0.0)


def _check_keys_against_config(keys: _Keys, s: ModelShape, tensors: dict[str, TensorEntry], file: str) -> list[Finding]:
    """Each key against the source's config.json, as the export stage gives it."""
    out = []

    def differs(code: str, template: str, have: Any, want: Any, why: str = "") -> None:
        out.append(finding(code, keys.key(template), f"is {have!r}; config.json says {want!r}{why}", file))

    exact = [
        (Keys.BLOCK_COUNT, s.num_layers, "num_hidden_layers"),
        (Keys.EMBEDDING_LENGTH, s.hidden_size, "hidden_size"),
        (Keys.HEAD_COUNT, s.num_heads, "num_attention_heads"),
        (Keys.CONTEXT_LENGTH, s.max_position_embeddings, "max_position_embeddings"),
    ]
    if s.mla is None:
        exact.append((Keys.HEAD_COUNT_KV, s.num_kv_heads, "num_key_value_heads"))
    else:  # MLA: one cached latent every head reads (multi-query), each head decompressed from it
        mla = s.mla
        exact += [
            (Keys.HEAD_COUNT_KV, 1, "MLA's one latent"),
            (Keys.KEY_LENGTH, mla.cache_width, "kv_lora_rank + qk_rope_head_dim"),
            (Keys.VALUE_LENGTH, mla.kv_lora_rank, "kv_lora_rank"),
            (Keys.KV_LORA_RANK, mla.kv_lora_rank, "kv_lora_rank"),
            (Keys.KEY_LENGTH_MLA, mla.qk_head_dim, "qk_nope_head_dim + qk_rope_head_dim"),
            (Keys.VALUE_LENGTH_MLA, mla.v_head_dim, "v_head_dim"),
        ]
        if mla.q_lora_rank is not None:
            exact.append((Keys.Q_LORA_RANK, mla.q_lora_rank, "q_lora_rank"))
    if s.moe is None or len(s.moe.sparse_layers) < s.num_layers:
        exact.append((Keys.FEED_FORWARD_LENGTH, s.intermediate_size, "intermediate_size"))
    for template, want, name in exact:
        have = keys.get(template)
        if have is not None and have != want:
            differs("CONFIG_MISMATCH", template, have, want, f" ({name})")
    key_length = keys.get(Keys.KEY_LENGTH) or (s.hidden_size // s.num_heads)
    if s.mla is None and key_length != s.head_dim:
        differs("CONFIG_MISMATCH", Keys.KEY_LENGTH, key_length, s.head_dim, " (head_dim)")
    eps = keys.get(Keys.LAYERNORM_RMS_EPS)
    if eps is not None and not math.isclose(float(eps), s.rms_norm_eps, rel_tol=1e-5):
        differs("CONFIG_MISMATCH", Keys.LAYERNORM_RMS_EPS, eps, s.rms_norm_eps)
    # Rope: the base of the full-attention layers (llama.cpp's freq_base) and of the sliding ones.
    kinds = set(s.layer_types) or {"full_attention"}
    main = s.rope_for("full_attention" if "full_attention" in kinds else "sliding_attention")
    base = keys.get(Keys.ROPE_FREQ_BASE)
    if base is not None and not _close(base, main.theta):
        differs("CONFIG_ROPE", Keys.ROPE_FREQ_BASE, base, main.theta, " (rope_theta)")
    swa_base = keys.get(ROPE_BASE_SWA)
    if (
        swa_base is not None
        and "sliding_attention" in kinds
        and not _close(swa_base, s.rope_for("sliding_attention").theta)
    ):
        differs("CONFIG_ROPE", ROPE_BASE_SWA, swa_base, s.rope_for("sliding_attention").theta)
    rot = keys.get(Keys.ROPE_DIMENSION_COUNT)
    want_rot = rope_dimensions(s)
    if rot is not None and rot != want_rot:
        why = " (qk_rope_head_dim)" if s.mla is not None else " (head_dim x partial_rotary_factor)"
        differs("CONFIG_ROPE", Keys.ROPE_DIMENSION_COUNT, rot, want_rot, why)
    if main.scaling != "default" and keys.get(ROPE_SCALING_TYPE) is None and "rope_freqs.weight" not in tensors:
        msg = f"is absent (and no rope_freqs.weight); config.json scales rope by {main.scaling!r}"
        out.append(finding("CONFIG_ROPE", keys.key(ROPE_SCALING_TYPE), msg, file))
    factor = keys.get(ROPE_SCALING_FACTOR)
    if factor is not None and main.factor is not None and not _close(factor, main.factor):
        differs("CONFIG_ROPE", ROPE_SCALING_FACTOR, factor, main.factor)
    # Sliding window: where it bites (shorter than the context), llama.cpp must apply it, on the same layers.
    window = keys.get(SLIDING_WINDOW) or None
    slides = "sliding_attention" in s.layer_types
    if (
        slides
        and s.sliding_window is not None
        and s.sliding_window < s.max_position_embeddings
        and window != s.sliding_window
    ):
        why = ": llama.cpp would attend over the whole context where the model sees a window"
        differs("CONFIG_SLIDING_WINDOW", SLIDING_WINDOW, window, s.sliding_window, why if window is None else "")
    elif not slides and window:
        differs("CONFIG_SLIDING_WINDOW", SLIDING_WINDOW, window, None, " (no layer slides)")
    pattern = _pattern(keys, s.num_layers)
    if pattern is not None and slides and pattern != s.layer_types:
        msg = f"makes layers {_kinds(pattern)} slide; config.json's layer_types {_kinds(s.layer_types)}"
        out.append(finding("CONFIG_LAYER_TYPES", keys.key(SLIDING_PATTERN), msg, file))
    # Experts.
    count_ = keys.get(EXPERT_COUNT)
    if s.moe is None and count_:
        differs("CONFIG_EXPERTS", EXPERT_COUNT, count_, None, " (a dense model)")
    elif s.moe is not None:
        # An expert's width: `expert_feed_forward_length` where the architecture has the key (qwen3moe), else
        # `feed_forward_length` (llama with experts: Mixtral), as the GGUF target writes them.
        expert_ff = EXPERT_FF if llama_cpp_arch(s).expert_feed_forward_key else Keys.FEED_FORWARD_LENGTH
        for template, want in (
            (EXPERT_COUNT, s.moe.experts),
            (EXPERT_USED_COUNT, s.moe.experts_per_token),
            (expert_ff, s.moe.intermediate_size),
        ):
            have = keys.get(template)
            if have != want:
                differs("CONFIG_EXPERTS", template, have, want)
    vocab = keys.get(Keys.VOCAB_SIZE)
    if vocab is not None and vocab != s.vocab_size:
        differs("CONFIG_MISMATCH", Keys.VOCAB_SIZE, vocab, s.vocab_size, " (vocab_size)")
    return out


def _kinds(kinds: tuple[Any, ...]) -> str:
    return _ranges([i for i, k in enumerate(kinds) if k == "sliding_attention"]) or "none"


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts: list[str] = []
    for x in xs:
        if parts and x == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{x}"
        else:
            parts.append(str(x))
    return ", ".join(parts[:8]) + (", ..." if len(parts) > 8 else "")


def expected_tensors(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor llama.cpp loads for `shape`, named as the GGUF target writes it (`targets.gguf.convert.layout`:
    one naming for writer and lint), with its shape (numpy order, as the reader gives it; experts stacked, MLA's
    kv_b and gpt-oss's gate_up split)."""
    return {p.name: p.shape for placed in layout(shape).values() for p in placed}


def _check_tensors(
    shape: ModelShape, arch: Architecture, tensors: dict[str, TensorEntry], file: str, *, source: bool
) -> list[Finding]:
    """The file's tensors against those its model implies: present, shaped, norms and biases in F32."""
    out = []
    want = expected_tensors(shape)
    said = "config.json" if source else "the file's keys"
    for name, dims in want.items():
        t = tensors.get(name)
        if t is None:
            out.append(finding("TENSOR_MISSING", name, f"{said} imply it ({list(dims)}) and it is absent", file))
            continue
        if t.shape != dims:
            out.append(finding("TENSOR_SHAPE", name, f"is {list(t.shape)}; {said} imply {list(dims)}", file))
        if len(dims) == 1 and t.type_id != TensorType.F32:
            out.append(finding("TENSOR_DTYPE", name, f"is {t.type_name}; llama.cpp's norms and biases are F32", file))
    for name in sorted(set(tensors) - set(want)):
        if name == "output.weight" or name == "rope_freqs.weight":
            continue  # llama.cpp reads an output head beside tied embeddings, and llama3's rope factors
        out.append(finding("TENSOR_UNEXPECTED", name, f"no tensor of {shape.architecture} as {said} describe it", file))
    return out


def _check_block_scales(path: Path, header: GGUFHeader, report: LintReport) -> None:
    """NaN or infinite block scales, and tensors whose every block scale is zero, one tensor at a time, read
    in chunks of about `CHUNK_BYTES` (a scale field is in every block, so every byte is read; memory is one
    chunk, whatever the tensor)."""
    import numpy as np

    file = path.name
    with open(path, "rb") as f:
        for t in header.tensors:
            try:
                ttype = TensorType(t.type_id)
            except ValueError:
                continue
            if ttype not in F16_SCALES and ttype is not TensorType.NVFP4:
                continue
            traits = TYPE_TRAITS[ttype]
            n = math.prod(t.shape) // traits.block_size
            step = max(1, CHUNK_BYTES // traits.type_size)
            nan = inf = 0
            nonzero = False
            fields = F16_SCALES.get(ttype, ())
            for c0 in range(0, n, step):
                blocks = min(step, n - c0)
                f.seek(header.data_offset + t.offset + c0 * traits.type_size)
                chunk = np.frombuffer(f.read(blocks * traits.type_size), dtype=np.uint8).reshape(blocks, -1)
                if ttype is TensorType.NVFP4:
                    d = chunk[:, :NVFP4_SCALES]
                    nonzero |= bool(((d != 0) & (d != 0x7F)).any())  # ggml decodes 0 and 0x7F as 0
                    continue
                for i, off in enumerate(fields):
                    c = f16_counts(chunk, off)
                    nan, inf = nan + c.nan, inf + c.inf
                    if i == 0:
                        nonzero |= c.zero < c.size
            report.scales += 1
            report.scale_bytes += n * (len(fields) * 2 or NVFP4_SCALES)
            what = f"block scales ({ttype.name} d)"
            if nan:
                report.add(finding("SCALE_NAN", t.name, f"{nan} of {n} {what} NaN", file))
            if inf:
                report.add(finding("SCALE_INF", t.name, f"{inf} of {n} {what} infinite", file))
            if n and not nonzero:
                report.add(finding("SCALE_ZERO", t.name, f"all {n} {what} zero: the tensor is all zeros", file))


def f16_counts(chunk: np.ndarray, off: int) -> ScaleCounts:
    """NaN, infinite and zero counts of the f16 field at byte `off` of each block (row of `chunk`), from its
    bits: an all-ones exponent is inf (mantissa 0) or NaN, and +-0 has every other bit clear."""
    import numpy as np

    bits = np.ascontiguousarray(chunk[:, off : off + 2]).view("<u2").reshape(-1)
    special = (bits & 0x7C00) == 0x7C00
    nan = int(np.count_nonzero(special & ((bits & 0x03FF) != 0)))
    return ScaleCounts(
        size=int(bits.size),
        nan=nan,
        inf=int(np.count_nonzero(special)) - nan,
        zero=int(np.count_nonzero((bits & 0x7FFF) == 0)),
        negative=0,  # a block's d carries the sign of its largest value (Q4_0: d = max / -8)
    )

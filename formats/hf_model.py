"""A Hugging Face model directory (config.json, tokenizer, SafeTensors weights): read a release,
check everything, and plan from headers alone.

`open_source(dir)` validates the directory (pickle refusal, file names, links and file types,
config.json's types and bounds, SafeTensors headers, shapes against config.json) without reading
any tensor data; `SourceModel.tensor(name)` then materialises one tensor at a time through a
memory-mapped `safe_open`, so peak memory is bounded by the largest tensor. The ingest stage
(`pipeline.stages.ingest`) copies what this checked into the content-addressed store.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from core.digest import sha256_file, sha256_json
from core.errors import SourceInvalid, UnsafeCheckpoint
from core.manifest import FileEntry, check_relative_path
from core.shape import ShapeRecord
from core.untrusted import InvalidJSON, loads_json, short_repr
from formats.safetensors import TensorInfo, read_header

if TYPE_CHECKING:
    import torch

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
PICKLE_REASON = "pickle checkpoint: never loaded"
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Buffers some exporters write that are recomputed at load time and carry no weights.
IGNORED_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class ArchFamily:
    """What a supported architecture looks like, as data."""

    name: str  # llama | mistral | qwen2
    attention_bias_default: bool


ARCHITECTURES: dict[str, ArchFamily] = {
    "LlamaForCausalLM": ArchFamily("llama", False),
    "MistralForCausalLM": ArchFamily("mistral", False),
    "Qwen2ForCausalLM": ArchFamily("qwen2", True),
}


# Upper bounds on config.json's sizes: several times the largest public models (vocab 262,144,
# hidden 16,384, intermediate 53,248, 126 layers, 128 heads, head_dim 256, context 10M), so a real
# model never meets them and a hostile config cannot ask for a billion layers.
CONFIG_LIMITS: dict[str, int] = {
    "vocab_size": 2**22,
    "hidden_size": 2**16,
    "intermediate_size": 2**18,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "max_position_embeddings": 2**24,
    "sliding_window": 2**24,
}
MAX_TOKEN_ID = 2**31 - 1
MAX_CONFIG_BYTES = 16 * 1024 * 1024
MAX_INDEX_BYTES = 64 * 1024 * 1024


def _size(name: str, default: Any = ...) -> Any:
    """A positive size bounded by CONFIG_LIMITS; required unless given a default."""
    return Field(default, gt=0, le=CONFIG_LIMITS[name])


_RopeTheta = Annotated[float, Field(gt=0, le=1e12, allow_inf_nan=False)]
_TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
# Keys whose explicit null means nothing to transformers: refused rather than read as "absent".
_NOT_NULL = (
    "rope_theta",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "hidden_act",
    "use_sliding_window",
    "mlp_bias",
    "partial_rotary_factor",
)


class RopeParameters(BaseModel):
    """`rope_parameters` (transformers 5) or `rope_scaling`: the keys kiln reads; others pass through."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    rope_theta: _RopeTheta | None = None
    rope_type: str | None = None
    type: str | None = None


class SourceConfig(BaseModel):
    """Every config.json key kiln reads, with exact types and bounds (validators only reject).

    Strict: `"false"` is not a bool, `64.0` is not an int, `true` is not a number, `1e400` (inf) and
    NaN are not floats. Keys kiln does not read are ignored. Explicit `null` means "absent" only
    where transformers reads it that way (head_dim, num_key_value_heads, sliding_window, token ids,
    rope_scaling, rope_parameters).
    """

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    architectures: list[str] = Field(min_length=1, max_length=1)
    vocab_size: int = _size("vocab_size")
    hidden_size: int = _size("hidden_size")
    intermediate_size: int = _size("intermediate_size")
    num_hidden_layers: int = _size("num_hidden_layers")
    num_attention_heads: int = _size("num_attention_heads")
    num_key_value_heads: int | None = _size("num_key_value_heads", None)
    head_dim: int | None = _size("head_dim", None)
    rope_theta: _RopeTheta | None = None
    rope_parameters: RopeParameters | None = None
    rope_scaling: RopeParameters | None = None
    rms_norm_eps: float = Field(default=1e-6, gt=0, lt=1, allow_inf_nan=False)
    max_position_embeddings: int = _size("max_position_embeddings", 2048)
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None  # absent: the family's default
    hidden_act: str = "silu"
    use_sliding_window: bool = False
    sliding_window: int | None = _size("sliding_window", None)
    mlp_bias: bool = False
    partial_rotary_factor: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    bos_token_id: _TokenId | None = None
    eos_token_id: _TokenId | list[_TokenId] | None = None
    pad_token_id: _TokenId | None = None
    unk_token_id: _TokenId | None = None

    @field_validator(*_NOT_NULL, mode="before")
    @classmethod
    def _not_null(cls, v: Any) -> Any:
        if v is None:
            raise ValueError("must not be null (leave the key out for the default)")
        return v

    @field_validator("eos_token_id", mode="before")
    @classmethod
    def _token_ids(cls, v: Any) -> Any:
        def ok(i: Any) -> bool:
            return type(i) is int and 0 <= i <= MAX_TOKEN_ID

        if v is None or ok(v) or (isinstance(v, list) and all(ok(i) for i in v)):
            return v
        raise ValueError(f"must be a token id (0..{MAX_TOKEN_ID}), a list of them, or null")


def _config_error(e: ValidationError) -> SourceInvalid:
    problems = []
    for err in e.errors():
        loc = ".".join(str(part) for part in err["loc"]) or "config"
        if err["type"] == "missing":
            problems.append((loc, "is required"))
            continue
        msg = err["msg"].removeprefix("Value error, ")
        problems.append((loc, f"{msg}, got {short_repr(err['input'])}"))
    return SourceInvalid(
        "config.json: " + "; ".join(f"{loc}: {msg}" for loc, msg in problems),
        details={
            "file": "config.json",
            "field": problems[0][0],
            "errors": [{"field": f, "message": m} for f, m in problems],
        },
    )


@dataclass(frozen=True)
class ModelShape:
    """The hyper-parameters every target needs, read once from config.json."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_id: int | None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        archs = config.get("architectures")
        if (
            not isinstance(archs, list)
            or len(archs) != 1
            or not isinstance(archs[0], str)
            or archs[0] not in ARCHITECTURES
        ):
            raise SourceInvalid(
                f"config.json: architectures={short_repr(archs)} is not supported; "
                f"supported: {', '.join(ARCHITECTURES)}",
                details={"file": "config.json", "field": "architectures"},
            )
        try:
            c = SourceConfig.model_validate(config)
        except ValidationError as e:
            raise _config_error(e) from None
        fam = ARCHITECTURES[c.architectures[0]]
        heads = c.num_attention_heads
        kv_heads = c.num_key_value_heads if c.num_key_value_heads is not None else heads
        if c.head_dim is not None:
            head_dim = c.head_dim
        elif c.hidden_size % heads == 0:
            head_dim = c.hidden_size // heads
        else:
            raise SourceInvalid(
                f"config.json: head_dim is absent and hidden_size={c.hidden_size} is not a multiple of "
                f"num_attention_heads={heads}",
                details={"file": "config.json", "field": "head_dim"},
            )
        if heads % kv_heads:
            raise SourceInvalid(
                f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}",
                details={"file": "config.json", "field": "num_key_value_heads"},
            )
        if head_dim % 2:
            raise SourceInvalid(
                f"config.json: head_dim={head_dim} must be even for rotary embeddings",
                details={"file": "config.json", "field": "head_dim"},
            )
        rope_theta = c.rope_theta
        if rope_theta is None and c.rope_parameters is not None:
            rope_theta = c.rope_parameters.rope_theta
        eos = c.eos_token_id
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            architecture=c.architectures[0],
            family=fam.name,
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            rms_norm_eps=c.rms_norm_eps,
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=c.tie_word_embeddings,
            attention_bias=c.attention_bias if c.attention_bias is not None else fam.attention_bias_default,
            bos_token_id=c.bos_token_id,
            eos_token_id=eos,
        )

    @property
    def tensor_count(self) -> int:
        """How many tensors `expected_tensors` names, computed without building it."""
        per_layer = 9 + (3 if self.attention_bias else 0)
        return 2 + (0 if self.tie_word_embeddings else 1) + self.num_layers * per_layer

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every weight tensor name the checkpoint must contain, with its shape."""
        h, q, kv, ff = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = (h,)
            out[p + "post_attention_layernorm.weight"] = (h,)
            out[p + "self_attn.q_proj.weight"] = (q, h)
            out[p + "self_attn.k_proj.weight"] = (kv, h)
            out[p + "self_attn.v_proj.weight"] = (kv, h)
            out[p + "self_attn.o_proj.weight"] = (h, q)
            if self.attention_bias:
                out[p + "self_attn.q_proj.bias"] = (q,)
                out[p + "self_attn.k_proj.bias"] = (kv,)
                out[p + "self_attn.v_proj.bias"] = (kv,)
            out[p + "mlp.gate_proj.weight"] = (ff, h)
            out[p + "mlp.up_proj.weight"] = (ff, h)
            out[p + "mlp.down_proj.weight"] = (h, ff)
        return out

    def record(self) -> ShapeRecord:
        """What the registry keeps about the model (a release's `model_config`): resolve sizes KV caches,
        tensor-parallel degrees and prefill FLOPs from it (`registry.resolve.fit`)."""
        return ShapeRecord(
            architecture=self.architecture,
            num_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
        )


@dataclass
class SourceModel:
    """A checked model directory: config, tokenizer and a plan of every tensor."""

    root: Path
    config: dict[str, Any]
    shape: ModelShape
    tensors: dict[str, TensorInfo]
    files: list[FileEntry]
    # Files in the directory that kiln does not use and a user might think it does, and why.
    ignored: list[tuple[str, str]] = field(default_factory=list)
    # Directories outside `root` that symbolic links among the used files may point into.
    allowed_roots: tuple[Path, ...] = ()

    @property
    def digest(self) -> str:
        """Source digest: sha256 over the canonical list of (path, sha256, size)."""
        return sha256_json([f.model_dump() for f in self.files])

    @property
    def weight_files(self) -> list[str]:
        return sorted({t.file for t in self.tensors.values()})

    @property
    def tokenizer_files(self) -> list[str]:
        return [f.path for f in self.files if f.path in TOKENIZER_FILES]

    def tensor(self, name: str) -> torch.Tensor:
        """Materialise one tensor (memory-mapped read) and check it is what the header planned.

        Each call opens its own `safe_open` handle: the returned tensor may be a view of that
        handle's memory map, which is released when the tensor is, so resident memory is bounded
        by the tensors the caller still holds, not by the files read so far.
        """
        from safetensors import safe_open

        info = self.tensors[name]
        with safe_open(str(self.root / info.file), framework="pt") as handle:
            t = handle.get_tensor(name)
        if tuple(t.shape) != info.shape:
            raise SourceInvalid(f"{info.file}: tensor {name!r} loaded as {tuple(t.shape)}, header said {info.shape}")
        return t

    def iter_tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names if names is not None else self.tensors:
            yield name, self.tensor(name)

    def close(self) -> None:
        """Kept for callers that scope a source with try/finally; tensors hold their own mappings."""


def open_source(
    root: str | Path,
    known_files: list[FileEntry] | None = None,
    hasher: Callable[[Path], str] = sha256_file,
    allowed_roots: Iterable[str | Path] = (),
) -> SourceModel:
    """Validate a model directory and plan from its headers; reads no tensor data.

    Every file kiln uses must be a regular file in `root`, or a symbolic link to one inside `root` or
    inside one of `allowed_roots` (the CLI's `--allow-outside`); links that leave them, dangling links,
    FIFOs and devices are refused before anything is read. Files kiln does not use but a user may
    think it does (pickle checkpoints beside SafeTensors, SafeTensors files the index does not name)
    are listed in `SourceModel.ignored` with the reason.

    Every file is hashed (with `hasher`, e.g. `core.digest.HashCache.sha256`) unless `known_files`
    (from a finished ingest stage, whose output is immutable and was hashed when it was committed)
    already gives the digests.
    """
    root = Path(root)
    if not root.is_dir():
        raise SourceInvalid(f"source {str(root)!r} is not a directory", details={"field": "source"})
    roots = (root.resolve(), *(Path(r).resolve() for r in allowed_roots))
    try:
        present = {p.name for p in root.iterdir()}
    except OSError as e:
        raise SourceInvalid(f"source {str(root)!r} cannot be listed ({e.strerror or e})") from None

    def checked(name: str) -> bool:
        if name not in present:
            return False
        _check_file(root, name, roots)
        return True

    checked(INDEX_FILE)  # before it is read for the weight file names
    weight_files, ignored = _weight_files(root, present)
    for wf in weight_files:
        checked(wf)
    checked("config.json")
    config = _read_json(root, "config.json", MAX_CONFIG_BYTES)
    shape = ModelShape.from_config(config)
    used = [*CONFIG_FILES, *TOKENIZER_FILES, *([INDEX_FILE] if INDEX_FILE in present else []), *weight_files]
    used = [p for p in used if checked(p)]
    if "tokenizer.json" not in used:
        raise SourceInvalid(
            "source has no tokenizer.json (a fast BPE tokenizer is required)", details={"file": "tokenizer.json"}
        )

    tensors: dict[str, TensorInfo] = {}
    for wf in weight_files:
        infos, _meta = read_header(root / wf, wf)
        for t in infos:
            if t.name in tensors:
                raise SourceInvalid(f"tensor {t.name!r} appears in both {tensors[t.name].file} and {wf}")
            tensors[t.name] = t
    if INDEX_FILE in present:
        _check_index(root, tensors)
    tensors = {n: t for n, t in tensors.items() if not n.endswith(IGNORED_TENSOR_SUFFIXES)}
    _check_against_config(shape, tensors)

    known = {f.path: f for f in known_files or []}
    files = [
        known[p] if p in known else FileEntry(path=p, sha256=hasher(root / p), size=(root / p).stat().st_size)
        for p in used
    ]
    expected = shape.expected_tensors()
    ordered = {n: tensors[n] for n in expected}  # canonical order: embeddings, layers, norm, head
    return SourceModel(
        root=root,
        config=config,
        shape=shape,
        tensors=ordered,
        files=files,
        ignored=ignored,
        allowed_roots=roots[1:],
    )


def open_shape(root: str | Path, allowed_roots: Iterable[str | Path] = ()) -> tuple[dict[str, Any], ModelShape]:
    """A shape-only source: config.json alone, checked as `open_source` checks it (a regular file in `root`
    or a link into `allowed_roots`, within the size limit, every key kiln reads valid); reads nothing else."""
    root = Path(root)
    if not root.is_dir():
        raise SourceInvalid(f"source {str(root)!r} is not a directory", details={"field": "source"})
    path = root / "config.json"
    if path.is_symlink() or path.exists():  # else _read_json says the source has none
        _check_file(root, "config.json", (root.resolve(), *(Path(r).resolve() for r in allowed_roots)))
    config = _read_json(root, "config.json", MAX_CONFIG_BYTES)
    return config, ModelShape.from_config(config)


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _check_file(root: Path, name: str, roots: tuple[Path, ...]) -> None:
    """Refuse a used file that is not a regular file, or a link that leaves `roots` (the source first)."""
    path = root / name
    try:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            target = Path(os.path.realpath(path))
            if not any(target.is_relative_to(r) for r in roots):
                allowed = "" if len(roots) == 1 else f" or the allowed directories ({', '.join(map(str, roots[1:]))})"
                raise UnsafeCheckpoint(
                    f"{name} is a symbolic link to {str(target)!r}, outside the source directory {str(roots[0])!r}"
                    f"{allowed}; kiln does not follow it (allow that directory with --allow-outside DIR)",
                    details={"file": name, "link_target": str(target)},
                )
            st = target.stat()
    except FileNotFoundError:
        what = f"is a symbolic link to {os.readlink(path)!r}, which" if path.is_symlink() else "disappeared: it"
        raise SourceInvalid(f"{name} {what} does not exist", details={"file": name}) from None
    except (OSError, RuntimeError) as e:  # a link loop, a permission problem
        raise SourceInvalid(
            f"{name} cannot be read ({getattr(e, 'strerror', None) or e})", details={"file": name}
        ) from None
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _FILE_KINDS if test(st.st_mode)), "not a regular file")
        raise SourceInvalid(f"{name} is {kind}, not a regular file", details={"file": name})


def _weight_files(root: Path, present: set[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """The SafeTensors files to read, and the weight-like files left alone with the reason."""
    pickles = sorted(p for p in present if p.endswith(PICKLE_SUFFIXES))
    if INDEX_FILE in present:
        index = _read_json(root, INDEX_FILE, MAX_INDEX_BYTES)
        wmap = index.get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise SourceInvalid(f"{INDEX_FILE}: weight_map must be a non-empty object", details={"file": INDEX_FILE})
        bad = next((f for f in wmap.values() if not isinstance(f, str)), None)
        if bad is not None:
            raise SourceInvalid(f"{INDEX_FILE}: file names must be strings, got {short_repr(bad)}")
        files = sorted(set(wmap.values()))
        unused = f"not named by {INDEX_FILE}: never read"
    elif SINGLE_FILE in present:
        files = [SINGLE_FILE]
        unused = f"no {INDEX_FILE}, so only {SINGLE_FILE} is read"
    else:
        if pickles:
            raise UnsafeCheckpoint(
                f"source holds only pickle checkpoints ({', '.join(pickles)}); pickle files can run arbitrary code "
                "when loaded, so kiln accepts SafeTensors only. Convert them with safetensors first.",
                details={"files": pickles},
            )
        raise SourceInvalid(f"source has neither {SINGLE_FILE} nor {INDEX_FILE}")
    for f in files:
        try:
            check_relative_path(f)
        except ValueError as e:
            raise UnsafeCheckpoint(f"{INDEX_FILE}: {e}", details={"file": f}) from None
        if "/" in f or not f.endswith(".safetensors"):
            raise UnsafeCheckpoint(f"weight file {short_repr(f)} must be a .safetensors file in the source directory")
        if f not in present:
            raise SourceInvalid(f"weight file {f!r} is missing", details={"file": f})
    ignored = [(p, PICKLE_REASON) for p in pickles]
    ignored += [(p, unused) for p in sorted(present) if p.endswith(".safetensors") and p not in files]
    return files, ignored


def _check_index(root: Path, tensors: dict[str, TensorInfo]) -> None:
    wmap: dict[str, str] = _read_json(root, INDEX_FILE, MAX_INDEX_BYTES)["weight_map"]
    for name, f in wmap.items():
        if name not in tensors:
            raise SourceInvalid(f"{INDEX_FILE}: tensor {name!r} is not in {f}", details={"tensor": name})
        if tensors[name].file != f:
            raise SourceInvalid(
                f"{INDEX_FILE}: tensor {name!r} is listed in {f} but found in {tensors[name].file}",
                details={"tensor": name},
            )
    extra = sorted(set(tensors) - set(wmap))
    if extra:
        raise SourceInvalid(
            f"{INDEX_FILE}: tensors not listed in the index: {extra[:5]}", details={"tensors": extra[:20]}
        )


def _check_against_config(shape: ModelShape, tensors: dict[str, TensorInfo]) -> None:
    # Count first: the expected names are only built for a config the headers can satisfy.
    if shape.tensor_count != len(tensors):
        raise SourceInvalid(
            f"config.json implies {shape.tensor_count} tensors ({shape.num_layers} layers, "
            f"tie_word_embeddings={shape.tie_word_embeddings}, attention_bias={shape.attention_bias}) "
            f"but the SafeTensors headers hold {len(tensors)}",
            details={"expected_count": shape.tensor_count, "count": len(tensors)},
        )
    expected = shape.expected_tensors()
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise SourceInvalid(
            f"{len(missing)} tensor(s) required by config.json are missing, e.g. {missing[0]!r}",
            details={"missing": missing[:20]},
        )
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise SourceInvalid(
            f"{len(unexpected)} tensor(s) not expected for {shape.architecture} with this config, "
            f"e.g. {unexpected[0]!r}",
            details={"unexpected": unexpected[:20]},
        )
    for name, want in expected.items():
        t = tensors[name]
        if t.shape != want:
            raise SourceInvalid(
                f"{t.file}: tensor {name!r} has shape {list(t.shape)}, config.json implies {list(want)}",
                details={"tensor": name, "shape": list(t.shape), "expected": list(want)},
            )
        if t.dtype not in ("F32", "F16", "BF16"):
            raise SourceInvalid(
                f"{t.file}: tensor {name!r} has dtype {t.dtype}; source weights must be F32, F16 or BF16"
            )


def _read_json(root: Path, name: str, max_bytes: int) -> dict[str, Any]:
    path = root / name
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise SourceInvalid(f"source has no {name}", details={"file": name}) from None
    except OSError as e:
        raise SourceInvalid(f"{name}: cannot be read ({e.strerror or e})", details={"file": name}) from None
    if len(raw) > max_bytes:
        raise SourceInvalid(f"{name}: larger than the {max_bytes}-byte limit", details={"file": name})
    try:
        # Numbers past a float's range reach the config schema as infinity, which then names the field.
        value = loads_json(raw, what=name, finite_numbers=False)
    except InvalidJSON as e:
        raise SourceInvalid(e.message, details={"file": name}) from None
    if not isinstance(value, dict):
        raise SourceInvalid(f"{name}: must be a JSON object", details={"file": name})
    return value

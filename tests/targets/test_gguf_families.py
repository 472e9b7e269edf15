"""GGUF for Qwen3, Qwen3-MoE, Mixtral, Gemma 3 and Phi-3, checked against llama.cpp itself.

For each family, on a tiny model from the test factory (rows of 256 and 512 values: every GGUF type applies):
- llama.cpp's own converter (`convert_hf_to_gguf.py` of the pinned llama-cpp-python's sdist, its vocabulary step
  skipped: it refuses the factory's tokenizer) and kiln write the same tensors (names, shapes, types, F16 bytes)
  and the same metadata keys and values, apart from the tokenizer keys the converter skipped, general.* naming,
  and the differences listed in `DIFFERENCES` with their reasons;
- kiln's Q8_0 file holds, tensor for tensor, the bytes llama.cpp's quantizer (`llama_model_quantize`) makes from
  the F16 file;
- llama.cpp loads kiln's F16, Q8_0 and Q4_K_M files and its logits agree with transformers' (fp32, same weights);
- what llama.cpp would compute differently is refused before anything is written (GGUF_UNSUPPORTED).
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from kiln.core.errors import InvalidInput
from kiln.eval.metrics import kl_divergence, log_softmax
from kiln.eval.runtimes.llama_cpp_runtime import LlamaCppRuntime
from kiln.formats.architectures.shape import ModelShape
from kiln.formats.gguf.constants import QUANTS, FileType
from kiln.formats.hf_model import open_source
from kiln.placement.weights import gguf_bytes
from kiln.targets.base import ExportRequest, ExportResult
from kiln.targets.gguf.convert import plan_tensors
from kiln.targets.gguf.export import check_supported, export, llama_quantize
from tests.llama_cpp_converter import convert, gguf_fields, gguf_tensors, vendored_llama_cpp
from tests.model_factory import NEW_FAMILIES, make_model

# Rows of 256 and 512 values, whole K-quant super-blocks; Gemma 3's query_pre_attn_scalar is its head_dim (as in
# Gemma 3 1B-12B: llama.cpp scales by head_dim) and its global layers scale rope linearly (as in Gemma 3 4B-27B).
SIZES: dict[str, Any] = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
CONFIG: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"moe_intermediate_size": 256},
    "gemma3": {
        "query_pre_attn_scalar": 64,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    },
}
ARCH = {
    "mistral": "llama",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
    "gemma3": "gemma3",
    "phi3": "phi3",
}
# Metadata keys the two files may differ in, and why. Beyond these the converter's file has general.* naming
# (name, size_label) kiln writes from the recipe, and no tokenizer.* keys (its vocabulary step is skipped).
DIFFERENCES: dict[str, dict[str, str]] = {
    family: {
        "general.type": "the converter says 'model'; llama.cpp reads general.type only to refuse a LoRA adapter "
        "loaded as a model",
        "general.alignment": "kiln writes the default alignment (32) explicitly; the converter leaves it implicit",
    }
    for family in NEW_FAMILIES
}
DIFFERENCES["gemma3"]["gemma3.attention.sliding_window_pattern"] = (
    "kiln writes each layer's kind from layer_types; without it llama.cpp assumes 5 sliding layers to 1 global, "
    "which is wrong for this model (sliding and global layers alternate): see "
    "test_gemma3_layer_kinds_are_written_for_llama_cpp"
)
DIFFERENCES["phi3"]["phi3.rope.scaling.original_context_length"] = (
    "llama.cpp reads it only for YaRN and LongRoPE scaling, which kiln refuses; kiln's config schema does not "
    "read original_max_position_embeddings"
)

TEXT = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text(encoding="utf-8")[2000:2500]


def _sharpen(model_dir: Path) -> None:
    """Attention far from uniform, so a wrong rope layout or window shows in the logits: q and k scaled by 4 (the
    families with q/k RMSNorms have sharp attention as they are)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for name, t in tensors.items():
        if any(p in name for p in (".q_proj.", ".k_proj.", ".qkv_proj.")):
            tensors[name] = t * 4
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in NEW_FAMILIES:
        out[family] = make_model(root / family, family, **SIZES, **CONFIG.get(family, {}))
        if family in ("mixtral", "phi3"):
            _sharpen(out[family])
    return out


@pytest.fixture(scope="module")
def exported(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], tuple[Path, ExportResult]]:
    root = tmp_path_factory.mktemp("families-out")
    cache: dict[tuple[str, str], tuple[Path, ExportResult]] = {}

    def get(family: str, quant: str) -> tuple[Path, ExportResult]:
        if (family, quant) not in cache:
            out = root / f"{family}-{quant}"
            req = ExportRequest(quant=quant, out_dir=out, params={"name": "tiny"})  # test_a_name_llama_cpp_looks_...
            res = export(open_source(models[family]), req)
            cache[family, quant] = (out / res.files[0], res)
        return cache[family, quant]

    return get


@pytest.fixture(scope="module")
def converted(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """llama.cpp's converter's F16 file of each family (all converted in one process); a family it cannot convert
    is skipped with the converter's error."""
    try:
        vendored = vendored_llama_cpp()
    except RuntimeError as e:
        pytest.skip(f"llama.cpp's converter is not available: {e}")
    root = tmp_path_factory.mktemp("converter")
    jobs = [(models[f], root / f"{f}.gguf", "f16") for f in NEW_FAMILIES]
    results = convert(vendored, jobs, root / "results.json")

    def get(family: str) -> Path:
        status = results[str(root / f"{family}.gguf")]
        if status != "ok":
            pytest.skip(f"llama.cpp's converter cannot convert {family}: {status}")
        return root / f"{family}.gguf"

    return get


@pytest.mark.slow
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_kiln_writes_what_llama_cpp_converter_writes(
    family: str, exported: Callable[..., tuple[Path, ExportResult]], converted: Callable[[str], Path]
) -> None:
    path, res = exported(family, "f16")
    peer = converted(family)
    ours, theirs = gguf_tensors(path), gguf_tensors(peer)
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        p = theirs[name]
        assert (t.tensor_type.name, list(t.shape)) == (p.tensor_type.name, list(p.shape)), name
        assert bytes(t.data) == bytes(p.data), f"{name}: F16 bytes differ"
    a, b = gguf_fields(path), gguf_fields(peer)
    allowed = DIFFERENCES[family]
    differ = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
    assert differ == set(allowed) & (set(a) | set(b)), {k: (a.get(k), b.get(k)) for k in differ}
    assert a["general.architecture"][0] == ARCH[family] == res.details["architecture"]
    if family in ("qwen3_moe", "mixtral"):
        assert any(n.endswith("ffn_gate_exps.weight") for n in ours)


@pytest.mark.slow
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_q8_0_is_what_llama_cpp_quantizer_makes_of_the_f16_file(
    family: str,
    exported: Callable[..., tuple[Path, ExportResult]],
    converted: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    ours = gguf_tensors(exported(family, "q8_0")[0])
    llama_quantize(converted(family), tmp_path / "q8_0.gguf", FileType.MOSTLY_Q8_0)
    theirs = gguf_tensors(tmp_path / "q8_0.gguf")
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        p = theirs[name]
        assert (t.tensor_type.name, list(t.shape)) == (p.tensor_type.name, list(p.shape)), name
        assert bytes(t.data) == bytes(p.data), f"{name}: Q8_0 bytes differ"
    assert {t.tensor_type.name for t in ours.values()} == {"Q8_0", "F32"}


@pytest.fixture(scope="module")
def reference(models: dict[str, Path]) -> Callable[[str], tuple[list[int], np.ndarray]]:
    """The token ids of TEXT and transformers' fp32 logits for them, per family."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache: dict[str, tuple[list[int], np.ndarray]] = {}

    def get(family: str) -> tuple[list[int], np.ndarray]:
        if family not in cache:
            ids = list(AutoTokenizer.from_pretrained(models[family])(TEXT, add_special_tokens=False)["input_ids"])
            model = AutoModelForCausalLM.from_pretrained(models[family], dtype=torch.float32)
            with torch.no_grad():
                cache[family] = (ids, model(torch.tensor([ids])).logits[0].double().numpy())
        return cache[family]

    return get


def _kl(ref: np.ndarray, path: Path, ids: list[int]) -> tuple[np.ndarray, float]:
    """KL(transformers || llama.cpp) at each position, and top-1 agreement."""
    runtime = LlamaCppRuntime(path, n_ctx=512, vocab_size=ref.shape[1])
    try:
        got = runtime.logits(ids)[:, : ref.shape[1]].astype(np.float64)
    finally:
        runtime.close()
    return kl_divergence(log_softmax(ref), log_softmax(got)), float(np.mean(ref.argmax(-1) == got.argmax(-1)))


# llama.cpp against transformers (fp32 logits from the same bf16 weights): mean KL per position and top-1. F16's
# mean is over all positions but the 1% that differ most: a router's top k is discontinuous, and where two experts
# score within llama.cpp's F16 rounding of each other (Mixtral here: 1.2e-4 apart in layer 1 at one of 240
# positions) it picks the other one.
LIMITS = {"f16": (1e-6, 0.97), "q8_0": (5e-4, 0.9), "q4_k_m": (1e-2, 0.4)}
# Measured on this file's models (AVX-512, 2026-11-29), F16 / Q8_0 / Q4_K_M mean KL over all positions:
# qwen3 1.6e-8 / 2.1e-5 / 1.9e-3, qwen3_moe 1.6e-8 / 1.6e-4 / 2.3e-3, mixtral 1.9e-5 (1.2e-7 without the flipped
# position) / 2.1e-4 / 5.6e-3, gemma3 3.5e-8 / 3.8e-5 / 2.3e-3, phi3 2.7e-8 / 3.0e-5 / 2.5e-3.


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["f16", "q8_0", "q4_k_m"])
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_llama_cpp_logits_agree_with_transformers(
    family: str, quant: str, exported: Callable[..., tuple[Path, ExportResult]], reference: Callable[..., Any]
) -> None:
    ids, ref = reference(family)
    assert len(ids) > 64  # past Gemma 3's window of 16: its sliding layers attend within it
    path, res = exported(family, quant)
    kl, top1 = _kl(ref, path, ids)
    limit, min_top1 = LIMITS[quant]
    kept = np.sort(kl)[: len(kl) - len(kl) // 100] if quant == "f16" else kl
    assert kept.mean() <= limit and top1 >= min_top1, (kl.mean(), kept.mean(), top1)
    if quant == "q4_k_m":  # llama.cpp's quantizer wrote its own mix, stacked experts included
        assert {"Q4_K", "Q6_K"} <= set(res.details["tensor_types"]) and "fallbacks" not in res.details


@pytest.mark.slow
def test_gemma3_layer_kinds_are_written_for_llama_cpp(
    exported: Callable[..., tuple[Path, ExportResult]], reference: Callable[..., Any], tmp_path: Path
) -> None:
    """Without `sliding_window_pattern` (as llama.cpp's converter writes the file) llama.cpp takes both layers for
    sliding ones, its default being 5 sliding layers to 1 global, and disagrees with transformers."""
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

    ids, ref = reference("gemma3")
    path, _ = exported("gemma3", "f16")
    key = "gemma3.attention.sliding_window_pattern"
    assert gguf.GGUFReader(path).fields[key].contents() == [True, False]
    without = tmp_path / "without-pattern.gguf"
    copy_with_new_metadata(gguf.GGUFReader(path), gguf.GGUFWriter(without, arch="gemma3"), {}, [key])
    ours = _kl(ref, path, ids)[0].mean()
    theirs = _kl(ref, without, ids)[0].mean()
    assert ours <= 1e-6 and theirs > 1e-3, (ours, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_the_plan_from_headers_is_what_is_written(
    family: str, models: dict[str, Path], exported: Callable[..., tuple[Path, ExportResult]]
) -> None:
    """Names, shapes (experts stacked) and types planned from the SafeTensors headers alone are the file's; the
    placement's byte count (`gguf_bytes`) is its tensors'."""
    source = open_source(models[family])
    for quant in ("f16", "q8_0"):
        path, _ = exported(family, quant)
        written = {
            t.name: (tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name, t.n_bytes)
            for t in gguf.GGUFReader(path).tensors
        }
        plans = plan_tensors(source.tensors, source.shape, QUANTS[quant])
        assert {p.name: (p.shape, p.ttype.name) for p in plans} == {n: w[:2] for n, w in written.items()}
        assert gguf_bytes(source.shape, quant) == sum(w[2] for w in written.values())
    stacked = [p for p in plans if len(p.sources) > 1]
    moe = source.shape.moe
    assert len(stacked) == (3 * source.shape.num_layers if moe else 0)
    if moe is not None:
        assert all(p.shape[0] == moe.experts and p.ttype.name == "Q8_0" for p in stacked)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The families at hidden 128 (quick to make; head_dim 64 as in `models`): for what the config or the name
    decides."""
    root = tmp_path_factory.mktemp("small")
    sizes: dict[str, Any] = dict(hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1)
    return {f: make_model(root / f, f, **sizes, **CONFIG.get(f, {})) for f in (*NEW_FAMILIES, "mistral")}


def _config(models: dict[str, Path], family: str, **changes: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads((models[family] / "config.json").read_text())
    cfg.update(changes)
    return cfg


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("qwen3_moe", {"norm_topk_prob": False}, "renormalises the chosen experts"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, "1 of its layers are dense"),
    (
        "qwen3",
        {"use_sliding_window": True, "sliding_window": 128, "layer_types": ["full_attention", "sliding_attention"]},
        "1 of 2 layers attend within a window of 128 tokens",
    ),
    ("mixtral", {"sliding_window": 64}, "window of 64 tokens"),
    ("mistral", {"sliding_window": 64}, "2 of 2 layers attend within a window of 64 tokens"),
    ("phi3", {"sliding_window": 256}, "window of 256 tokens"),
    ("phi3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, "rope scaling 'yarn'"),
    ("gemma3", {"query_pre_attn_scalar": 256}, "query_pre_attn_scalar=256"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    (
        "gemma3",
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
            }
        },
        "rope scaling 'linear' on its sliding_attention layers",
    ),
    (
        "qwen3",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
        "rotates 32 of each head's 64",
    ),
]


@pytest.mark.parametrize(("family", "changes", "says"), REFUSED)
def test_what_llama_cpp_computes_differently_is_refused(
    family: str, changes: dict[str, Any], says: str, small: dict[str, Path]
) -> None:
    shape = ModelShape.from_config(_config(small, family, **changes))
    with pytest.raises(InvalidInput, match=f"as llama.cpp's {ARCH[family]}: .*{says}") as e:
        check_supported(shape)
    assert e.value.code == "GGUF_UNSUPPORTED"
    check_supported(ModelShape.from_config(_config(small, family)))  # the unchanged model is written


def test_phi3_window_as_long_as_its_context_is_no_window(small: dict[str, Path]) -> None:
    """A window that never excludes a token (>= the context) computes what llama.cpp computes; it is written."""
    check_supported(ModelShape.from_config(_config(small, "phi3", sliding_window=512)))


def test_a_name_llama_cpp_looks_tokens_up_for_is_refused(small: dict[str, Path], tmp_path: Path) -> None:
    """llama.cpp's vocabulary loader looks '</s>', '<unk>' and '<s>' up for any general.name containing 'phi3' and
    fails without them; the factory's tokenizer has none: the export says so rather than write a file llama.cpp
    cannot load. Under another name (the target's `name` param) the same model is written."""
    out = tmp_path / "out"
    with pytest.raises(InvalidInput, match="'</s>', '<unk>', '<s>'") as e:
        export(open_source(small["phi3"]), ExportRequest(quant="f16", out_dir=out))  # named after its directory
    assert e.value.code == "GGUF_NAME_UNSUPPORTED"
    assert not list(out.glob("*.gguf*")) and not list(out.glob(".*"))


@pytest.mark.slow
def test_linear_rope_scaling_is_written_for_every_architecture(tmp_path: Path) -> None:
    """Linear rope scaling (positions divided by the factor) is arithmetic every llama.cpp graph shares: a Llama
    with it is written with rope.scaling.type/factor, and llama.cpp's logits agree with transformers'."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    model = make_model(tmp_path / "m", "llama", **SIZES, rope_parameters=rope)
    _sharpen(model)
    res = export(open_source(model), ExportRequest(quant="f16", out_dir=tmp_path / "out"))
    path = tmp_path / "out" / res.files[0]
    fields = gguf.GGUFReader(path).fields
    assert fields["llama.rope.scaling.type"].contents() == "linear"
    assert fields["llama.rope.scaling.factor"].contents() == 4.0
    ids = list(AutoTokenizer.from_pretrained(model)(TEXT, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)(torch.tensor([ids])).logits[0]
    kl, top1 = _kl(ref.double().numpy(), path, ids)
    assert kl.mean() <= 1e-6 and top1 >= 0.97, (kl.mean(), top1)


@pytest.mark.parametrize("quant", ["f16", "q8_0"])
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_every_familys_file_passes_the_lint(family: str, quant: str, exported: Any, models: dict[str, Path]) -> None:
    """What the writer writes, the lint (which the export stage runs) passes: one naming and one set of keys."""
    from kiln.targets.lint import lint_artifact

    path, _ = exported(family, quant)
    report = lint_artifact(path.parent, shape=open_source(models[family]).shape, quant=quant, target="gguf")
    assert report.errors == [], [(f.code, f.subject, f.message) for f in report.errors]

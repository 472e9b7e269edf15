"""The artifact lint as a user meets it: every artifact kiln builds passes, and each fault that breaks a real
load is caught with its code and the tensor or key named.

Each bad artifact is a good one (an hf-bundle from `make_bundle`, a GGUF, orbax or TensorRT-LLM export) with
exactly one thing corrupted, as a faulty quantizer, converter or copy would leave it.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.formats.architectures.shape import ModelShape
from kiln.formats.gguf.reader import read_header
from kiln.formats.hf_model import open_source
from kiln.quant.catalog import get_scheme
from kiln.quant.store import open_quantized, write_quantized
from kiln.targets.base import ExportRequest, get_target
from kiln.targets.lint import CODES, LintReport, LintRequest, detect_format, lint_artifact
from tests.model_factory import make_bundle, make_model

# (family, make_model kwargs); the llama's widths are whole 128-blocks (fp8-block) and int4 groups.
SOURCES: dict[str, dict[str, Any]] = {
    "llama": dict(family="llama", hidden_size=128, intermediate_size=256, num_kv_heads=4),
    "qwen3_moe": dict(family="qwen3_moe", hidden_size=128),
    "gemma3": dict(family="gemma3", hidden_size=128),
}
# Every good artifact: name -> (source, target, quant).
GOOD: dict[str, tuple[str, str, str]] = {
    "llama-hf-bf16": ("llama", "hf-bundle", "bf16"),
    "llama-hf-fp8": ("llama", "hf-bundle", "fp8"),
    "llama-hf-fp8-block": ("llama", "hf-bundle", "fp8-block"),
    "llama-hf-fp8-kv8": ("llama", "hf-bundle", "fp8-kv8"),
    "llama-hf-int4-rtn": ("llama", "hf-bundle", "int4-rtn"),
    "llama-hf-nvfp4-w4a4": ("llama", "hf-bundle", "nvfp4-w4a4"),
    "llama-hf-mxfp4-w4a4": ("llama", "hf-bundle", "mxfp4-w4a4"),
    "llama-rocm-fp8": ("llama", "rocm-bundle", "fp8"),
    "llama-gguf-q8_0": ("llama", "gguf", "q8_0"),
    "llama-gguf-q4_k_m": ("llama", "gguf", "q4_k_m"),
    "llama-orbax-int8": ("llama", "orbax", "int8-w8a16"),
    "llama-trtllm-int4": ("llama", "trtllm", "int4-rtn"),
    "qwen3_moe-hf-fp8": ("qwen3_moe", "hf-bundle", "fp8"),
    "gemma3-hf-bf16": ("gemma3", "hf-bundle", "bf16"),
}
ROCM_PARAMS = {"gfx_arch": "gfx942", "fp8_dtype": "e4m3fnuz", "vllm": "0.11.2", "rocm": "7.0.2"}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """artifact(name) -> the good artifact's directory, built once per module when first asked for."""
    root = tmp_path_factory.mktemp("lint")
    sources: dict[str, Path] = {}
    built: dict[str, Path] = {}

    def source(name: str) -> Path:
        if name not in sources:
            sources[name] = make_model(root / "src" / name, **SOURCES[name])
        return sources[name]

    def get(name: str) -> Path:
        if name in built:
            return built[name]
        src_name, target, quant = GOOD[name]
        src = source(src_name)
        out = root / name
        if target in ("hf-bundle", "rocm-bundle"):
            built[name] = make_bundle(src, out, quant, target, ROCM_PARAMS if target == "rocm-bundle" else None)
            return built[name]
        quantized = None
        if quant in get_target(target).quantized_input:  # round-to-nearest schemes: no calibration
            qdir = root / f"{name}-quantize"
            qdir.mkdir()
            write_quantized(open_source(src), get_scheme(quant), qdir)
            quantized = open_quantized(qdir, quant)
        params = {"mesh": {"data": 1, "model": 2}} if target == "orbax" else {}
        out.mkdir(parents=True)
        get_target(target).export(
            open_source(src), ExportRequest(quant=quant, out_dir=out, params=params, quantized=quantized)
        )
        built[name] = out
        return out

    get.source = source  # type: ignore[attr-defined]
    return get


def shape_of(artifact: Callable[[str], Path], name: str) -> ModelShape:
    return open_source(artifact.source(GOOD[name][0])).shape  # type: ignore[attr-defined]


def lint(path: Path, shape: ModelShape | None = None, quant: str | None = None) -> LintReport:
    return lint_artifact(path, shape=shape, quant=quant)


def errors(report: LintReport) -> set[tuple[str, str]]:
    return {(f.code, f.subject) for f in report.errors}


def bad_copy(artifact: Callable[[str], Path], name: str, tmp_path: Path) -> Path:
    out = tmp_path / name
    shutil.copytree(artifact(name), out)
    return out


def edit_tensors(bundle: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite the bundle's single shard with `edit` applied to its tensors (a dict it changes in place)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(bundle / "model.safetensors")
    edit(tensors)
    save_file(tensors, bundle / "model.safetensors", metadata={"format": "pt"})


def edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc, indent=2))


# -- every good artifact passes --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(GOOD))
def test_every_good_artifact_passes_with_and_without_its_source(artifact: Callable[[str], Path], name: str) -> None:
    path = artifact(name)
    _, target, quant = GOOD[name]
    assert detect_format(path) == get_target(target).format
    alone = lint(path)
    assert alone.findings == [], alone.findings
    checked = get_target(target).lint(LintRequest(path, shape_of(artifact, name), quant))  # type: ignore[misc]
    assert checked.findings == [], checked.findings
    assert checked.tensors > 0
    if quant not in ("bf16",):
        assert checked.scales > 0  # the scales were read, not only listed


def test_every_code_is_documented() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "targets.md").read_text()
    missing = [code for code in CODES if f"`{code}`" not in docs]
    assert missing == []


# -- 1. scales: zero, NaN, inf, missing ------------------------------------------------------------------------


def test_nan_scale_of_one_expert_is_named(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    bad = bad_copy(artifact, "qwen3_moe-hf-fp8", tmp_path)
    name = "model.layers.1.mlp.experts.5.down_proj.weight_scale"

    def nan(t: dict[str, Any]) -> None:
        t[name][3, 0] = float("nan")

    edit_tensors(bad, nan)
    report = lint(bad)
    assert errors(report) == {("SCALE_NAN", name)}
    assert "1 of 128 value(s) NaN" in report.errors[0].message


@pytest.mark.parametrize(
    ("local", "value", "code"),
    [("input_global_scale", 0.0, "SCALE_ZERO"), ("weight_global_scale", float("inf"), "SCALE_INF")],
)
def test_nvfp4_tensor_scales_zero_or_infinite(
    artifact: Callable[[str], Path], tmp_path: Path, local: str, value: float, code: str
) -> None:
    """An NVFP4 Linear whose calibration saw nothing: its tensor scale is 0 or inf, and vLLM computes NaN."""
    bad = bad_copy(artifact, "llama-hf-nvfp4-w4a4", tmp_path)
    name = f"model.layers.0.mlp.up_proj.{local}"
    edit_tensors(bad, lambda t: t[name].fill_(value))
    assert errors(lint(bad)) == {(code, name)}


def test_missing_weight_scale_and_kv_scale(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    int4 = bad_copy(artifact, "llama-hf-int4-rtn", tmp_path)
    name = "model.layers.1.self_attn.o_proj.weight_scale"
    edit_tensors(int4, lambda t: t.pop(name))
    assert errors(lint(int4)) == {("SCALE_MISSING", name)}

    kv8 = bad_copy(artifact, "llama-hf-fp8-kv8", tmp_path)
    edit_tensors(kv8, lambda t: t.pop("model.layers.1.self_attn.v_scale"))
    assert errors(lint(kv8)) == {("SCALE_MISSING", "model.layers.1.self_attn.v_scale")}


def test_mxfp4_exponent_scale_nan(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    """MXFP4 scales are E8M0 exponent bytes: 0xFF is their NaN."""
    bad = bad_copy(artifact, "llama-hf-mxfp4-w4a4", tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight_scale"

    def nan(t: dict[str, Any]) -> None:
        t[name][0, 1] = 0xFF

    edit_tensors(bad, nan)
    assert errors(lint(bad)) == {("SCALE_NAN", name)}


def _patch_gguf_scales(path: Path, tensor: str, patch: Callable[[np.ndarray], None]) -> None:
    """Patch the f16 `d` field of a Q8_0 tensor's blocks in place (each block: d, then 32 int8)."""
    header = read_header(path)
    t = next(t for t in header.tensors if t.name == tensor)
    assert t.type_name == "Q8_0"
    n = int(np.prod(t.shape)) // 32
    data = np.memmap(path, dtype=np.uint8, mode="r+", offset=header.data_offset + t.offset, shape=(n * 34,))
    d = data.reshape(n, 34)[:, :2].copy().view("<f2").reshape(-1)
    patch(d)
    data.reshape(n, 34)[:, :2] = d.view(np.uint8).reshape(n, 2)
    data.flush()
    del data


def test_gguf_block_scales_nan_or_all_zero(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    bad = bad_copy(artifact, "llama-gguf-q8_0", tmp_path)
    path = bad / "model-q8_0.gguf"

    def nan(d: np.ndarray) -> None:
        d[3] = np.nan

    _patch_gguf_scales(path, "blk.1.ffn_down.weight", nan)
    assert errors(lint(bad)) == {("SCALE_NAN", "blk.1.ffn_down.weight")}

    zero = bad_copy(artifact, "llama-gguf-q8_0", tmp_path / "z")

    def zeros(d: np.ndarray) -> None:
        d[:] = 0

    _patch_gguf_scales(zero / "model-q8_0.gguf", "blk.0.attn_k.weight", zeros)
    assert errors(lint(zero)) == {("SCALE_ZERO", "blk.0.attn_k.weight")}


def test_orbax_int8_scale_nan(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    import tensorstore as ts

    bad = bad_copy(artifact, "llama-orbax-int8", tmp_path)
    name = "model.layers.0.mlp.gate_proj.weight_scale"
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(bad / "checkpoint" / "state" / name)}}
    array = ts.open(spec, open=True).result()
    array[7].write(np.float32("nan")).result()
    assert errors(lint(bad)) == {("SCALE_NAN", name)}


def test_modelopt_pre_quant_scale_zero(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    bad = bad_copy(artifact, "llama-trtllm-int4", tmp_path)
    name = "model.layers.1.mlp.down_proj.pre_quant_scale"
    edit_tensors(bad, lambda t: t[name].zero_())
    assert errors(lint(bad)) == {("SCALE_ZERO", name)}


# -- 2. lm_head quantized where a runtime says it is not, or the reverse -------------------------------------


def test_quantized_head_in_a_compressed_tensors_bundle(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    import torch

    bad = bad_copy(artifact, "llama-hf-fp8", tmp_path)

    def quantize_head(t: dict[str, Any]) -> None:
        w = t["lm_head.weight"].float()
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        t["lm_head.weight"] = (w / scale).to(torch.float8_e4m3fn)
        t["lm_head.weight_scale"] = scale.to(torch.bfloat16)

    edit_tensors(bad, quantize_head)
    report = lint(bad)
    assert errors(report) == {("LM_HEAD_QUANT", "lm_head")}
    assert "quantization_config.ignore lists it" in report.errors[0].message


def test_head_the_config_quantizes_but_stored_plain(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    bad = bad_copy(artifact, "llama-hf-int4-rtn", tmp_path)
    edit_json(bad / "config.json", lambda c: c["quantization_config"].update(ignore=[]))
    report = lint(bad)
    assert errors(report) == {("LM_HEAD_QUANT", "lm_head")}
    assert "stored unquantized" in report.errors[0].message


def test_modelopt_head_not_excluded(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    bad = bad_copy(artifact, "llama-trtllm-int4", tmp_path)
    edit_json(bad / "hf_quant_config.json", lambda c: c["quantization"].update(exclude_modules=[]))
    assert errors(lint(bad)) == {("LM_HEAD_QUANT", "lm_head")}


def test_a_layer_stored_quantized_that_the_config_ignores(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    bad = bad_copy(artifact, "llama-hf-fp8", tmp_path)
    edit_json(bad / "config.json", lambda c: c["quantization_config"]["ignore"].append("re:.*o_proj$"))
    assert errors(lint(bad)) == {("QUANT_TARGET_MISMATCH", f"model.layers.{i}.self_attn.o_proj") for i in range(2)}


# -- 3. per-expert vs stacked layouts, and scale shapes vs the strategy -------------------------------------


def test_stacked_scale_beside_per_expert_weights(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    import torch

    bad = bad_copy(artifact, "qwen3_moe-hf-fp8", tmp_path)
    stacked = "model.layers.0.mlp.experts.gate_proj.weight_scale"

    def stack(t: dict[str, Any]) -> None:
        names = [f"model.layers.0.mlp.experts.{e}.gate_proj.weight_scale" for e in range(8)]
        t[stacked] = torch.stack([t.pop(n) for n in names])

    edit_tensors(bad, stack)
    report = lint(bad)
    assert errors(report) == {("SCALE_LAYOUT", stacked)}
    assert "per-expert" in report.errors[0].message


@pytest.mark.parametrize(
    ("name", "tensor", "reshape"),
    [
        # int4 groups of 128 on a 256-wide input: [out, 2], written per channel instead.
        ("llama-hf-int4-rtn", "model.layers.0.mlp.down_proj.weight_scale", lambda s: s[:, :1].clone()),
        # fp8 in 128x128 blocks: [1, 1] for a 128x128 weight, written per channel instead.
        ("llama-hf-fp8-block", "model.layers.1.self_attn.q_proj.weight_scale", lambda s: s.expand(128, 1).clone()),
    ],
)
def test_scale_shape_against_the_strategy(
    artifact: Callable[[str], Path], tmp_path: Path, name: str, tensor: str, reshape: Callable[[Any], Any]
) -> None:
    bad = bad_copy(artifact, name, tmp_path)

    def edit(t: dict[str, Any]) -> None:
        t[tensor] = reshape(t[tensor])

    edit_tensors(bad, edit)
    report = lint(bad)
    assert errors(report) == {("SCALE_SHAPE", tensor)}


# -- 4. layer_types / sliding window / rope / experts metadata ------------------------------------------------


def test_layer_types_longer_than_the_layers(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    bad = bad_copy(artifact, "gemma3-hf-bf16", tmp_path)
    edit_json(bad / "config.json", lambda c: c["layer_types"].append("sliding_attention"))
    report = lint(bad)
    assert errors(report) == {("CONFIG_LAYER_TYPES", "layer_types")}
    assert "3 entries for num_hidden_layers=2" in report.errors[0].message


@pytest.mark.parametrize(
    ("edit", "code", "subject"),
    [
        (lambda c: c["rope_parameters"].pop("sliding_attention"), "CONFIG_ROPE", "rope_parameters"),
        (lambda c: c.update(sliding_window=None), "CONFIG_SLIDING_WINDOW", "sliding_window"),
    ],
)
def test_gemma3_rope_and_window_metadata(
    artifact: Callable[[str], Path], tmp_path: Path, edit: Callable[[dict[str, Any]], None], code: str, subject: str
) -> None:
    bad = bad_copy(artifact, "gemma3-hf-bf16", tmp_path)
    edit_json(bad / "config.json", edit)
    assert errors(lint(bad)) == {(code, subject)}


def _patch_gguf_value(path: Path, key: str, fmt: str, value: Any) -> None:
    """Overwrite a scalar metadata value in place (its key, then a u32 type, then the value)."""
    raw = path.read_bytes()
    encoded = struct.pack("<Q", len(key)) + key.encode()
    at = raw.index(encoded) + len(encoded) + 4
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(struct.pack(fmt, value))


def _add_gguf_keys(src: Path, dst: Path, keys: dict[str, tuple[Any, Any]]) -> None:
    """Copy a GGUF with keys added, by gguf-py's own metadata tool."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()  # type: ignore[union-attr]
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    new = {k: MetadataDetails(vtype, v) for k, (vtype, v) in keys.items()}
    copy_with_new_metadata(reader, writer, new, [])


def test_gguf_rope_base_disagrees_with_the_config(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    bad = bad_copy(artifact, "llama-gguf-q8_0", tmp_path)
    _patch_gguf_value(bad / "model-q8_0.gguf", "llama.rope.freq_base", "<f", 500000.0)
    assert lint(bad).findings == []  # consistent with itself: only the source's config says otherwise
    report = lint(bad, shape_of(artifact, "llama-gguf-q8_0"))
    assert errors(report) == {("CONFIG_ROPE", "llama.rope.freq_base")}
    assert "500000.0" in report.errors[0].message and "10000.0" in report.errors[0].message


@pytest.mark.parametrize(
    ("key", "value", "code"),
    [
        ("llama.attention.sliding_window", 16, "CONFIG_SLIDING_WINDOW"),
        ("llama.expert_count", 8, "CONFIG_EXPERTS"),
    ],
)
def test_gguf_window_and_experts_keys_the_config_does_not_have(
    artifact: Callable[[str], Path], tmp_path: Path, key: str, value: int, code: str
) -> None:
    import gguf

    good = artifact("llama-gguf-q8_0")
    bad = tmp_path / "bad"
    bad.mkdir()
    _add_gguf_keys(good / "model-q8_0.gguf", bad / "model-q8_0.gguf", {key: (gguf.GGUFValueType.UINT32, value)})
    report = lint(bad, shape_of(artifact, "llama-gguf-q8_0"))
    assert (code, key) in errors(report)
    assert {c for c, _ in errors(report)} == {code}


def test_gguf_block_count_disagrees_with_its_tensors(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    bad = bad_copy(artifact, "llama-gguf-q8_0", tmp_path)
    _patch_gguf_value(bad / "model-q8_0.gguf", "llama.block_count", "<I", 3)
    found = errors(lint(bad))
    assert ("CONFIG_MISMATCH", "llama.block_count") in found
    assert {s for c, s in found if c != "CONFIG_MISMATCH"} == {
        s for c, s in found if c == "TENSOR_MISSING" and s.startswith("blk.2.")
    }


def test_orbax_config_says_more_layers_than_weights_json(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    bad = bad_copy(artifact, "llama-orbax-int8", tmp_path)
    edit_json(bad / "config.json", lambda c: c.update(num_hidden_layers=3))
    found = errors(lint(bad))
    assert ("CONFIG_MISMATCH", "num_hidden_layers") in found
    assert {c for c, _ in found} == {"CONFIG_MISMATCH", "TENSOR_MISSING", "SCALE_MISSING"}
    assert all(s.startswith("model.layers.2.") for c, s in found if c != "CONFIG_MISMATCH")


# -- 5. every tensor present, with its dtype and shape; nothing else; valid headers ---------------------------


def test_missing_norm_and_unexpected_tensor(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    import torch

    missing = bad_copy(artifact, "llama-hf-fp8", tmp_path)
    edit_tensors(missing, lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
    assert errors(lint(missing)) == {("TENSOR_MISSING", "model.layers.1.post_attention_layernorm.weight")}

    extra = bad_copy(artifact, "llama-hf-fp8", tmp_path / "x")
    edit_tensors(extra, lambda t: t.update({"model.layers.0.mlp.gate_proj.bias": torch.zeros(256)}))
    assert errors(lint(extra)) == {("TENSOR_UNEXPECTED", "model.layers.0.mlp.gate_proj.bias")}


def test_packed_weight_shape_and_its_weight_shape_tensor(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    """compressed-tensors int4: weight_packed int32 [out, in / 8] and weight_shape holding [out, in]."""
    import torch

    packed = bad_copy(artifact, "llama-hf-int4-rtn", tmp_path)
    name = "model.layers.0.mlp.up_proj.weight_packed"
    edit_tensors(packed, lambda t: t.update({name: t[name][:, :8].clone()}))
    report = lint(packed)
    assert errors(report) == {("TENSOR_SHAPE", name)}
    assert "[256, 16]" in report.errors[0].message

    shape = bad_copy(artifact, "llama-hf-int4-rtn", tmp_path / "s")
    name = "model.layers.1.mlp.gate_proj.weight_shape"
    edit_tensors(shape, lambda t: t.update({name: torch.tensor([256, 64])}))
    assert errors(lint(shape)) == {("TENSOR_SHAPE", name)}


def test_wrong_dtype_of_a_quantized_weight(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    import torch

    bad = bad_copy(artifact, "llama-hf-fp8", tmp_path)
    name = "model.layers.0.self_attn.v_proj.weight"
    edit_tensors(bad, lambda t: t.update({name: t[name].to(torch.float16)}))
    assert errors(lint(bad)) == {("TENSOR_DTYPE", name)}


def test_truncated_shard_and_truncated_gguf(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    bundle = bad_copy(artifact, "llama-hf-fp8", tmp_path)
    shard = bundle / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    assert errors(lint(bundle)) == {("SAFETENSORS_HEADER", "model.safetensors")}

    gguf = bad_copy(artifact, "llama-gguf-q8_0", tmp_path)
    path = gguf / "model-q8_0.gguf"
    path.write_bytes(path.read_bytes()[:4096])
    assert errors(lint(gguf)) == {("GGUF_HEADER", "model-q8_0.gguf")}


def test_orbax_array_missing_from_the_checkpoint(artifact: Callable[[str], Path], tmp_path: Path) -> None:
    bad = bad_copy(artifact, "llama-orbax-int8", tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    shutil.rmtree(bad / "checkpoint" / "state" / name)
    assert errors(lint(bad)) == {("TENSOR_MISSING", name)}


def test_artifact_from_another_model_than_its_source(artifact: Callable[[str], Path]) -> None:
    """With the source's config (as the export stage lints), a bundle of another model is refused."""
    report = lint(artifact("gemma3-hf-bf16"), shape_of(artifact, "llama-hf-fp8"))
    assert ("CONFIG_MISMATCH", "family") in errors(report)


def test_an_artifact_of_a_prequantized_source_is_compared_with_its_shape_deliberately() -> None:
    """A release's own quantized layout (`source_quant`) is the source's: an artifact that dequantized it, or holds
    compressed-tensors (config.json without a release layout), is not a mismatch; one that declares another is."""
    from kiln.targets.lint.config import compare_shapes

    released = json.loads((Path(__file__).parents[2] / "examples" / "deepseek-v3" / "config.json").read_text())
    source = ModelShape.from_config(released)
    assert source.source_quant is not None
    plain = {k: v for k, v in released.items() if k != "quantization_config"}
    assert compare_shapes(ModelShape.from_config(plain), source, "config.json") == []
    assert compare_shapes(ModelShape.from_config(released), source, "config.json") == []
    other = {**released, "quantization_config": {**released["quantization_config"], "weight_block_size": [64, 64]}}
    (finding,) = compare_shapes(ModelShape.from_config(other), source, "config.json")
    assert (finding.code, finding.subject) == ("CONFIG_MISMATCH", "source_quant")

"""A minimal GGUF writer for Llama-family test models, independent of kiln's own exporter.

Written with the `gguf` package's `GGUFWriter`, following llama.cpp's converter: q/k rows permuted
for llama.cpp's rope layout, tokenizer metadata from tokenizer.json. It lets the llama.cpp runtime
be tested without depending on `targets.gguf` (which the end-to-end tests cover).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, the two rope halves interleaved (as in convert_hf_to_gguf)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(
    model_dir: Path, out: Path, *, dtype: str = "f32", pad_vocab: int = 0, permute_qk: bool = True
) -> Path:
    """Write the Llama model in `model_dir` as one GGUF file (`dtype` f32 or f16 for 2-D weights).

    `pad_vocab` adds that many padding tokens, with embedding rows of zeros and output rows that
    are twice the first real rows (so a runtime that does not ignore them would be visibly off).
    `permute_qk=False` writes a deliberately broken file (rope layout wrong) for negative tests.
    """
    import gguf
    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head

    tensors: dict[str, np.ndarray] = {}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
            tensors[name] = f.get_tensor(name).float().numpy()

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"] + pad_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)

    vocab: dict[str, int] = tok["model"]["vocab"]
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
    vocab = {**vocab, **special}
    by_id = {i: s for s, i in vocab.items()}
    n_vocab = cfg["vocab_size"] + pad_vocab
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n_vocab)]
    types = [
        gguf.TokenType.CONTROL if s in special else gguf.TokenType.UNUSED if i not in by_id else gguf.TokenType.NORMAL
        for i, s in enumerate(tokens)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)

    def put(name: str, t: np.ndarray) -> None:
        out_dtype = np.float16 if dtype == "f16" and t.ndim == 2 else np.float32
        w.add_tensor(name, np.ascontiguousarray(t.astype(out_dtype)))

    embed, head = tensors["model.embed_tokens.weight"], tensors.get("lm_head.weight")
    if pad_vocab:
        embed = np.concatenate([embed, np.zeros((pad_vocab, embed.shape[1]), embed.dtype)])
        if head is not None:
            head = np.concatenate([head, 2.0 * head[:pad_vocab]])
    qk = _permute if permute_qk else (lambda t, n: t)
    put("token_embd.weight", embed)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", tensors[p + "input_layernorm.weight"])
        put(f"blk.{i}.attn_q.weight", qk(tensors[p + "self_attn.q_proj.weight"], n_head))
        put(f"blk.{i}.attn_k.weight", qk(tensors[p + "self_attn.k_proj.weight"], n_kv))
        put(f"blk.{i}.attn_v.weight", tensors[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", tensors[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_norm.weight", tensors[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.ffn_gate.weight", tensors[p + "mlp.gate_proj.weight"])
        put(f"blk.{i}.ffn_up.weight", tensors[p + "mlp.up_proj.weight"])
        put(f"blk.{i}.ffn_down.weight", tensors[p + "mlp.down_proj.weight"])
    put("output_norm.weight", tensors["model.norm.weight"])
    if head is not None:
        put("output.weight", head)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out

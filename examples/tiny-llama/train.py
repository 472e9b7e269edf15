"""Build kiln's bundled example model: a tiny Llama trained on Python stdlib source.

The script is deterministic and needs no network access. It

1. builds a corpus from the ``*.py`` files of the running interpreter's standard
   library (sorted by relative path; test suites, vendored packages and
   generated data tables are skipped) and splits it by file into a training set
   and a fixed held-out set (``HELDOUT_FILES``, never trained on);
2. trains a 4096-entry byte-level BPE tokenizer (GPT-2 pre-tokenizer regex, so
   llama.cpp's "gpt-2" pre-tokenizer reproduces it) whose only special token is
   ``<|endoftext|>`` (bos = eos = pad);
3. trains a ``LlamaForCausalLM`` (4 layers, d=256, GQA 8/4 heads) in fp32 on
   the training tokens, documents separated by ``<|endoftext|>``; with
   ``--family qwen3_moe``, a ``Qwen3MoeForCausalLM`` of the same attention whose
   MLPs are 8 experts of width d/2, 2 per token (the router trained with its
   load-balancing loss);
4. saves model (bf16 safetensors) and tokenizer to ``<out>/model/`` and the
   held-out text to ``<out>/heldout.txt``;
5. reloads the saved model with transformers, measures held-out perplexity
   over non-overlapping 256-token windows, and writes ``<out>/model_card.json``
   and ``<out>/README.md``.

Retrain (from the repository root)::

    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 .venv/bin/python examples/tiny-llama/train.py

The corpus is whatever the running Python ships, so byte-identical artifacts
need the same Python version (recorded in the model card) and library versions.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sysconfig
import time
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
)

HERE = Path(__file__).resolve().parent
EOT = "<|endoftext|>"
VOCAB_SIZE = 4096

# Stdlib modules held out from tokenizer and model training (~88 KB of text).
HELDOUT_FILES = ("bisect.py", "fractions.py", "heapq.py", "shlex.py", "textwrap.py")
# Directories skipped anywhere in the stdlib tree: test suites, third-party
# packages, bytecode caches, and generated data (doc dumps, codec tables).
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__", "pydoc_data", "encodings"})


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output directory (default: %(default)s)")
    parser.add_argument(
        "--family",
        choices=("llama", "qwen3_moe"),
        default="llama",
        help="llama, or qwen3_moe: 8 experts of width hidden/2, 2 per token (default: %(default)s)",
    )
    parser.add_argument("--name", default="tiny-llama", help="the model card's name (default: %(default)s)")
    parser.add_argument(
        "--hidden",
        type=int,
        default=256,
        help="hidden size; intermediate is 3x, 32-wide heads, half as many KV heads (default: %(default)s)",
    )
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=50, help="linear warmup steps (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    return parser.parse_args()


def load_corpus() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Return (train, heldout) lists of (relative path, text), sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, heldout = [], []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        dirs = rel.parts[:-1]
        if any(d in EXCLUDED_DIRS or d.startswith("config-") for d in dirs):
            continue
        if rel.name.startswith("_sysconfigdata"):  # build-machine specific
            continue
        doc = (rel.as_posix(), path.read_text(encoding="utf-8"))
        (heldout if rel.as_posix() in HELDOUT_FILES else train).append(doc)
    missing = set(HELDOUT_FILES) - {name for name, _ in heldout}
    if missing:
        raise SystemExit(f"held-out files missing from {root}: {sorted(missing)}")
    return train, heldout


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


# The mixture of experts of `--family qwen3_moe`: many narrow experts, few per token, as the released MoEs are
# shaped; the router's load-balancing loss keeps every expert in use while it trains.
EXPERTS = 8
EXPERTS_PER_TOKEN = 2
ROUTER_AUX_LOSS = 0.01


def model_config(eot_id: int, hidden: int = 256, family: str = "llama") -> PreTrainedConfig:
    if hidden % 64:
        raise SystemExit(f"--hidden must be a multiple of 64 (32-wide heads, KV heads half of them), got {hidden}")
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=hidden,
            intermediate_size=3 * hidden,  # the width of a dense layer; every layer here is sparse
            moe_intermediate_size=hidden // 2,
            num_experts=EXPERTS,
            num_experts_per_tok=EXPERTS_PER_TOKEN,
            norm_topk_prob=True,
            output_router_logits=True,
            router_aux_loss_coef=ROUTER_AUX_LOSS,
            num_hidden_layers=4,
            num_attention_heads=hidden // 32,
            num_key_value_heads=hidden // 64,
            head_dim=32,
            max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            rms_norm_eps=1e-5,
            hidden_act="silu",
            attention_bias=False,
            tie_word_embeddings=False,
            bos_token_id=eot_id,
            eos_token_id=eot_id,
            pad_token_id=eot_id,
        )
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=4,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
    )


def train_model(model: PreTrainedModel, stream: torch.Tensor, args: argparse.Namespace) -> list[float]:
    """Train on shuffled non-overlapping windows of ``stream``; return per-step losses."""
    windows = stream[: len(stream) // args.seq_len * args.seq_len].view(-1, args.seq_len)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.empty(0, dtype=torch.long)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    def lr_factor(step: int) -> float:  # linear warmup, cosine decay to 10% of peak
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(args.steps):
        if len(order) < args.batch_size:  # new epoch: fresh seeded permutation
            order = torch.cat([order, torch.randperm(len(windows), generator=gen)])
        batch, order = windows[order[: args.batch_size]], order[args.batch_size :]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

        if step == 0 or (step + 1) % 10 == 0 or step + 1 == args.steps:
            elapsed = time.perf_counter() - start
            eta = elapsed / (step + 1) * (args.steps - step - 1)
            recent = sum(losses[-10:]) / len(losses[-10:])
            print(
                f"step {step + 1:4d}/{args.steps}  loss {recent:.3f}  "
                f"lr {scheduler.get_last_lr()[0]:.2e}  {elapsed / (step + 1):.2f} s/step  "
                f"elapsed {elapsed:.0f}s  eta {eta:.0f}s",
                flush=True,
            )
    return losses


@torch.no_grad()
def heldout_perplexity(model_dir: Path, text: str, seq_len: int) -> tuple[float, int]:
    """Perplexity of the saved model (computed in fp32) over non-overlapping windows."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if tokenizer.decode(ids) != text:
        raise SystemExit("tokenizer round trip failed: decode(encode(heldout)) != heldout")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for start in range(0, len(ids), seq_len):
        window = torch.tensor([ids[start : start + seq_len]])
        if window.shape[1] < 2:
            continue
        predicted = window.shape[1] - 1
        nll += model(input_ids=window, labels=window).loss.item() * predicted
        count += predicted
    return math.exp(nll / count), len(ids)


def _mlp(cfg: dict) -> str:
    if "num_experts" in cfg:
        return (
            f"{cfg['num_experts']} experts of width {cfg['moe_intermediate_size']} per layer, "
            f"{cfg['num_experts_per_tok']} per token (renormalised)"
        )
    return f"intermediate {cfg['intermediate_size']}"


def write_readme(path: Path, card: dict) -> None:
    cfg = card["config"]
    path.write_text(
        f"""# {card["name"]}: kiln's bundled example model

A small but genuinely trained {card["architecture"].removesuffix("ForCausalLM")}-architecture causal LM ({card["params"]:,} parameters)
with its own byte-level BPE tokenizer, used as kiln's end-to-end example artifact.
It was trained from scratch on the Python {card["corpus"]["python"]} standard library source code, so it
writes Python-flavoured text; it is a test fixture, not a useful assistant.

- `model/`: transformers checkpoint (`config.json`, bf16 `model.safetensors`,
  `generation_config.json`) plus tokenizer (`tokenizer.json`, `tokenizer_config.json`).
- `heldout.txt`: held-out evaluation text ({", ".join(card["corpus"]["heldout_files"])},
  joined by blank lines); these files were excluded from tokenizer and model training.
- `model_card.json`: configuration and measured figures.
- `train.py`: the deterministic script that produced all of the above.

## Architecture

`{card["architecture"]}`: vocab {cfg["vocab_size"]}, hidden {cfg["hidden_size"]}, {_mlp(cfg)},
{cfg["num_hidden_layers"]} layers, {cfg["num_attention_heads"]} attention heads / {cfg["num_key_value_heads"]} KV heads (GQA), SiLU, RMSNorm eps {cfg["rms_norm_eps"]},
RoPE theta {cfg["rope_theta"]}, max positions {cfg["max_position_embeddings"]}, untied embeddings, no attention bias.

Tokenizer: byte-level BPE (`tokenizers`), {cfg["vocab_size"]} tokens, GPT-2 pre-tokenizer regex
(llama.cpp pre-tokenizer "gpt-2"), no prefix space; `<|endoftext|>` (id {card["eot_id"]}) is bos, eos and pad.

## Measured figures

| | |
|---|---|
| parameters | {card["params"]:,} |
| `model.safetensors` (bf16) | {card["safetensors_bytes"]:,} bytes |
| training corpus | {card["corpus"]["train_files"]} files, {card["corpus"]["train_tokens"]:,} tokens |
| training | {card["training"]["steps"]} steps x {card["training"]["batch_size"]} x {card["training"]["seq_len"]} tokens ({card["training"]["tokens_seen"]:,} tokens seen), fp32 AdamW |
| training time | {card["training"]["train_seconds"]:.0f} s on {card["training"]["threads"]} CPU threads |
| final training loss (mean of last 10 steps) | {card["training"]["final_loss"]:.3f} |
| held-out perplexity (bf16 weights, fp32 compute, {card["eval"]["window"]}-token windows) | {card["eval"]["perplexity"]:.2f} over {card["eval"]["tokens"]:,} tokens |

## Retraining

From the repository root:

```sh
ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 .venv/bin/python examples/tiny-llama/train.py
```

(`ONEDNN_MAX_CPU_ISA` works around CPUs whose AMX support crashes oneDNN.) Data order,
initialisation and tokenizer training are seeded/deterministic; the corpus is the running
interpreter's standard library, so reproducing these exact weights needs Python
{card["corpus"]["python"]} and the library versions recorded in `model_card.json`.
`--steps`, `--batch-size`, `--out` etc. override the committed configuration.
""",
        encoding="utf-8",
    )


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model_dir = args.out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)

    train_docs, heldout_docs = load_corpus()
    heldout_text = "\n\n".join(text for _, text in heldout_docs)
    (args.out / "heldout.txt").write_text(heldout_text, encoding="utf-8")
    train_texts = [text for _, text in train_docs]
    print(
        f"corpus: {len(train_docs)} train files, {len(heldout_docs)} held-out files "
        f"({len(heldout_text.encode()):,} bytes)",
        flush=True,
    )

    tokenizer = train_tokenizer(train_texts)
    eot_id = tokenizer.token_to_id(EOT)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    stream = []
    for encoding in tokenizer.encode_batch(train_texts):
        stream.extend(encoding.ids)
        stream.append(eot_id)
    stream = torch.tensor(stream[:-1], dtype=torch.long)  # EOT between files only
    print(
        f"tokenizer: vocab {tokenizer.get_vocab_size()}, eot id {eot_id}, {len(stream):,} training tokens", flush=True
    )

    model = AutoModelForCausalLM.from_config(model_config(eot_id, args.hidden, args.family))
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {params:,} parameters; training {args.steps} steps of {args.batch_size}x{args.seq_len} tokens",
        flush=True,
    )
    start = time.perf_counter()
    losses = train_model(model, stream, args)
    train_seconds = time.perf_counter() - start

    if args.family == "qwen3_moe":  # the load-balancing loss is for training; a release computes no router logits
        model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(model_dir)
    hf_tokenizer.save_pretrained(model_dir)

    perplexity, heldout_tokens = heldout_perplexity(model_dir, heldout_text, args.seq_len)
    config = model.config
    card = {
        "name": args.name,
        "architecture": config.architectures[0] if config.architectures else type(model).__name__,
        "params": params,
        "eot_id": eot_id,
        "config": {
            "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "max_position_embeddings": config.max_position_embeddings,
            "rope_theta": config.rope_parameters["rope_theta"],
            "rms_norm_eps": config.rms_norm_eps,
            "hidden_act": config.hidden_act,
            "tie_word_embeddings": config.tie_word_embeddings,
            "dtype": "bfloat16",
            **(
                {
                    "num_experts": config.num_experts,
                    "num_experts_per_tok": config.num_experts_per_tok,
                    "moe_intermediate_size": config.moe_intermediate_size,
                    "norm_topk_prob": config.norm_topk_prob,
                    "router_aux_loss_coef": config.router_aux_loss_coef,
                }
                if args.family == "qwen3_moe"
                else {}
            ),
        },
        "safetensors_bytes": (model_dir / "model.safetensors").stat().st_size,
        "model_dir_bytes": sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file()),
        "corpus": {
            "source": "Python standard library *.py files",
            "python": platform.python_version(),
            "train_files": len(train_docs),
            "train_tokens": len(stream),
            "heldout_files": list(HELDOUT_FILES),
            "excluded_dirs": sorted(EXCLUDED_DIRS),
        },
        "training": {
            "steps": args.steps,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "tokens_seen": args.steps * args.batch_size * args.seq_len,
            "peak_lr": args.lr,
            "warmup_steps": args.warmup,
            "seed": args.seed,
            "threads": args.threads,
            "train_seconds": round(train_seconds, 1),
            "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4),
        },
        "eval": {
            "heldout_bytes": len(heldout_text.encode()),
            "tokens": heldout_tokens,
            "window": args.seq_len,
            "perplexity": round(perplexity, 3),
        },
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }
    (args.out / "model_card.json").write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8")
    write_readme(args.out / "README.md", card)

    print(
        json.dumps(
            {
                "params": params,
                "safetensors_bytes": card["safetensors_bytes"],
                "model_dir_bytes": card["model_dir_bytes"],
                "train_tokens": len(stream),
                "steps": args.steps,
                "train_seconds": card["training"]["train_seconds"],
                "final_train_loss": card["training"]["final_loss"],
                "heldout_perplexity": card["eval"]["perplexity"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

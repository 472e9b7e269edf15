"""Benchmark: where FP8 (per-channel E4M3 weights, dynamic per-token E4M3 activations) loses top-1.

    python bench/fp8_sensitivity.py [--model examples/tiny-llama/model] [--text examples/tiny-llama/heldout.txt]

On the eval's own windows (`eval.text.load_text`, 4,096 tokens in 256-token windows), the model
runs in float32 with FP8 round trips inserted exactly where vLLM's per-token FP8 path quantizes:
each Linear's weight rounded to e4m3fn with one scale per output channel (absmax / 448, rounded up
to bf16 as the quantize stage stores it), and its input rounded to e4m3fn with one scale per token
(absmax / 448), `lm_head` kept in bf16 as the `fp8` scheme does. The FP8 round trips are switched on
for every Linear (also once with float32 weight scales: an equally valid rounding, showing how much
top-1 moves with the noise's realisation alone), weights only, activations only, one projection
kind at a time, and one decoder layer at a time. Each row reports mean KL and
top-1 agreement against the unquantized model. Top-1 flips are then split by how close the
reference's top two tokens were. The run's record is printed as JSON and appended to --record.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from record import add_record_argument, run_record, save_record  # bench/record.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

E4M3_MAX = 448.0
KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_round_trip(t, scale=None):  # type: ignore[no-untyped-def]
    """e4m3fn quantize-dequantize with one scale per row of the last dimension (default: absmax / 448)."""
    import torch

    if scale is None:
        scale = t.abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (t / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(t.dtype) * scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "examples/tiny-llama/model")
    parser.add_argument("--text", type=Path, default=ROOT / "examples/tiny-llama/heldout.txt")
    parser.add_argument("--threads", type=int, default=2)
    add_record_argument(parser, "fp8_sensitivity")
    args = parser.parse_args()

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from kiln.eval.metrics import kl_divergence, log_softmax
    from kiln.eval.text import load_text
    from kiln.quant.catalog import SCHEMES
    from kiln.quant.rtn import weight_scale

    torch.set_num_threads(args.threads)
    text = load_text(args.model, args.text)
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32).eval()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")}
    originals = {n: m.weight.data.clone() for n, m in linears.items()}
    # The quantize stage's per-channel scales: absmax / 448 rounded up to bf16, as the checkpoint stores them.
    fp8_weights = SCHEMES["fp8"].weights
    assert fp8_weights is not None
    stored = {n: fp8_round_trip(w, weight_scale(w, fp8_weights)) for n, w in originals.items()}
    exact = {n: fp8_round_trip(w) for n, w in originals.items()}

    @torch.no_grad()
    def logits(
        names: set[str], weights: bool = True, activations: bool = True, quantized: dict | None = None
    ) -> np.ndarray:
        quantized = stored if quantized is None else quantized
        hooks = []
        for n, m in linears.items():
            m.weight.data = quantized[n] if weights and n in names else originals[n]
            if activations and n in names:
                hooks.append(m.register_forward_pre_hook(lambda _m, inp: (fp8_round_trip(inp[0]),)))
        try:
            rows = [model(input_ids=torch.tensor([w])).logits[0, :-1] for w in text.windows]
        finally:
            for h in hooks:
                h.remove()
        return torch.cat(rows).double().numpy()

    ref_logp = log_softmax(logits(set()))
    ref_top = ref_logp.argmax(-1)
    probs = np.sort(np.exp(ref_logp), axis=-1)
    gap = probs[:, -1] - probs[:, -2]  # the reference's top-1 minus top-2 probability

    rows: list[dict] = []

    def measure(label: str, names: set[str], **kw: Any) -> dict:
        cand_logp = log_softmax(logits(names, **kw))
        flips = cand_logp.argmax(-1) != ref_top
        row = {
            "fp8 on": label,
            "mean_kl": float(kl_divergence(ref_logp, cand_logp).mean()),
            "top1": float(1 - flips.mean()),
            "flips": int(flips.sum()),
            "flip_gap_median": float(np.median(gap[flips])) if flips.any() else None,
            "flips_gap_under_0.05": int((gap[flips] < 0.05).sum()),
        }
        rows.append(row)
        return row

    every = set(linears)
    measure("every Linear (weights + activations)", every)
    measure("every Linear, float32 weight scales", every, quantized=exact)
    measure("every Linear, weights only", every, activations=False)
    measure("every Linear, activations only", every, weights=False)
    for kind in KINDS:
        measure(kind, {n for n in every if n.endswith(kind)})
    for layer in range(model.config.num_hidden_layers):
        measure(f"layer {layer}", {n for n in every if f"layers.{layer}." in n})

    print(f"{args.model}: {len(ref_top)} scored tokens; reference top-2 gap median {np.median(gap):.4f}")
    print(f"{'fp8 on':40} {'mean KL':>9} {'top-1':>7} {'flips':>6} {'flip gap med':>13} {'gap<0.05':>9}")
    for r in rows:
        med = "-" if r["flip_gap_median"] is None else f"{r['flip_gap_median']:.4f}"
        print(
            f"{r['fp8 on']:40} {r['mean_kl']:9.2e} {r['top1']:7.4f} {r['flips']:6d} {med:>13} "
            f"{r['flips_gap_under_0.05']:9d}"
        )
    save_record(
        run_record(
            model=str(args.model),
            scored_tokens=len(ref_top),
            reference_gap_median=float(np.median(gap)),
            rows=rows,
        ),
        args.record,
    )


if __name__ == "__main__":
    main()

"""Eval: load each artifact in the runtime that will serve it and compare it with the reference.

- `eval.text`      tokenise held-out text once into fixed windows and greedy prompts.
- `eval.runtimes`  the `Runtime` protocol and its implementations (transformers, llama.cpp).
- `eval.metrics`   pure, streaming metrics over logits (perplexity, KL, top-1, greedy match).
- `eval.gates`     per-scheme pass/fail thresholds (documented defaults, recipe overrides).
- `eval.report`    `judged(metrics, gate)`: the `EvalReport` published with an artifact.
- `eval.run`       `evaluate(reference, candidate, text, gate)` ties them together.

The records that cross the wire (`EvalMetrics`, `Gate`, `EvalReport`) are defined in `core.evals`,
which the registry and the client read too; `eval.gates` and `eval.report` use them from there and
import neither numpy nor torch.
"""

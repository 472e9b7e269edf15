"""Eval: load each artifact in the runtime that will serve it and compare it with the reference.

- `eval.text`      tokenise held-out text once into fixed windows and greedy prompts.
- `eval.runtimes`  the `Runtime` protocol and its implementations (transformers, llama.cpp).
- `eval.metrics`   pure, streaming metrics over logits (perplexity, KL, top-1, greedy match).
- `eval.gates`     per-scheme pass/fail thresholds (documented defaults, recipe overrides).
- `eval.report`    `EvalReport`, the JSON record published with an artifact.
- `eval.run`       `evaluate(reference, candidate, text, gate)` ties them together.

`eval.gates` and `eval.report` import neither numpy nor torch, so the registry (whose base
install has neither) can read and validate published reports.
"""

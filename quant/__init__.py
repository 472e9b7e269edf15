"""Quantization, schemes and kernels side by side (as compressed-tensors keeps schemes and compressors).

- `schemes` — the types a method's storage is made of (`Scheme`, `WeightQuant`, `ActivationQuant`), frozen
  and validated, and `Verdict`.
- `methods` — the quantization methods, one module per family (`dense`, `fp8`, `int8`, `int4`): each one's
  scheme, the dtypes it stores and computes in, its KV cache, default eval gate and hardware verdicts.
- `catalog` — the one table of methods (`METHODS`, `SCHEMES`, `get_scheme`) and `compatibility`, the
  verdict of a method on every hardware profile.
- `rtn` — the quantizers, pure functions over `(name, tensor)` pairs: symmetric round-to-nearest
  int4 (per group) and int8 (per channel), and FP8 E4M3 per channel. They yield exactly the
  tensors a compressed-tensors checkpoint stores (`weight_packed`/`weight_scale`/`weight_shape`
  for `pack-quantized`, an FP8 `weight` + `weight_scale` for `float-quantized`).
- `calibrated` — GPTQ and AWQ through llm-compressor, on CPU.
- `compressed` — the bridge to compressed-tensors: a `quant.schemes.Scheme` as its
  `QuantizationScheme`, and the `quantization_config` block of config.json as it writes it.
- `store` — the quantize stage's output on disk: the quantized tensors in one SafeTensors file
  plus the `quantization_config`, opened lazily by the exports that consume it.
"""

"""Quantization, schemes and kernels side by side (as compressed-tensors keeps schemes and compressors).

- `schemes` — the schemes as frozen, validated data with named presets, and the hardware each runs on.
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

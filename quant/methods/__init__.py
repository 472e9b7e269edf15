"""The quantization methods, one module per family: `dense` (bf16), `fp8`, `int8`, `int4`, `fp4`.

Each module defines its methods (`base.Method`: the scheme, the dtypes it stores and computes in, its KV
cache, its default eval gate and its verdicts on CUDA and ROCm) and lists them in `METHODS`; `quant.catalog`
gathers them into the one table every other quant-keyed table is derived from or checked against.
"""

"""GGUF v3: `constants` (the format as data: value and tensor types, block sizes, keys), `reader`
(the header, bounded and checked), `writer` (a streaming state machine), `quants` (F16/BF16/Q8_0/Q4_0
encoders). Source: ggml-org/llama.cpp `gguf-py/gguf/constants.py`, `ggml/src/gguf.cpp`."""

"""Sizing, in one place: a model's arithmetic (`model`: parameters total and active, experts touched, KV-cache
bytes, tensor-parallel degrees), a replica's fit and bounds on a hardware profile (`fit`), and an artifact's
weight bytes per quant (`weights`). Below the pipeline, the registry and the routing renderer, which all
import it; above the quantization catalog and the formats it reads."""

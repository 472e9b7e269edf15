import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # AMX is advertised but faults here

# moto's S3 server, one for the session: the registry's blob store and the pipeline's stage store use it.
from tests.registry.s3_server import s3_server  # noqa: E402, F401 - the fixture

"""The whole schema: every domain's tables on the one MetaData (`registry.db.Base`).

Here rather than in `registry.db`, which every domain's ORM module imports: the module that gathers the
domains sits above them, so the database plumbing imports none of them.
"""

from __future__ import annotations

from sqlalchemy import MetaData

from kiln.registry.artifacts import models as _artifacts  # noqa: F401
from kiln.registry.attestations import models as _attestations  # noqa: F401
from kiln.registry.audit import models as _audit  # noqa: F401
from kiln.registry.auth import models as _auth  # noqa: F401
from kiln.registry.blobs import models as _blobs  # noqa: F401
from kiln.registry.channels import models as _channels  # noqa: F401
from kiln.registry.db import Base
from kiln.registry.hardware import models as _hardware  # noqa: F401
from kiln.registry.models import models as _models  # noqa: F401
from kiln.registry.oci import models as _oci  # noqa: F401
from kiln.registry.performance import models as _performance  # noqa: F401
from kiln.registry.releases import models as _releases  # noqa: F401
from kiln.registry.resolve import models as _resolve  # noqa: F401
from kiln.registry.webhooks import models as _webhooks  # noqa: F401


def registry_metadata() -> MetaData:
    """The MetaData of every table the registry has (the one the migrations compare)."""
    return Base.metadata

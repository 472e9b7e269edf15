"""The kiln registry: a FastAPI service that stores models, releases, artifacts and their blobs,
evaluation results and channels, and answers "what should this hardware load?" (`/v1/resolve`).

Layout: one sub-package per domain (`models`, `releases`, `artifacts`, `blobs`, `channels`,
`audit`, `resolve`), each with `models.py` (ORM rows), `schemas.py` (API shapes), `service.py`
(functions over a Session that raise `core.errors`) and `routes.py` (HTTP). `app.create_app`
wires them; `api.errors` maps error codes to HTTP statuses; `client.RegistryClient` talks to it.
"""

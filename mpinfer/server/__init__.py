"""The HTTP server on rank 0: the app and its faces (routes.py, tgi.py, oai.py, oairoutes.py)
with their bodies as pydantic models, the shared request rules (api.py), the guard in front of
them (guard.py), streaming and metrics (streams.py), chat templates (chat.py), /openapi.json from
the models (openapi.py) and `mpinfer serve` (serve.py). Nothing here touches the model."""

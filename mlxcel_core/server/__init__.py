"""`mlxcel serve`: an OpenAI-compatible HTTP server on the batch engine (Starlette + uvicorn).

app.py routes, schemas.py request bodies, replies.py response shapes, engine_loop.py the one engine
thread, errors.py the OpenAI error envelope, metrics.py Prometheus metrics.
"""

from .app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]

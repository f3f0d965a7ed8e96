"""`ee-jax serve`: the engine behind an OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from ee_jax.serving.server.app import ServerConfig, create_app
from ee_jax.serving.server.engine_loop import EngineLoop, Event
from ee_jax.serving.server.run import BackgroundServer, listen, serve
from ee_jax.serving.server.startup import Startup

__all__ = ["BackgroundServer", "EngineLoop", "Event", "ServerConfig", "Startup", "create_app",
           "listen", "serve"]

"""Running the app: in the foreground (`ee-jax serve`) or in a background thread (tests,
notebooks)."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import uvicorn

from ee_jax.serving.engine import LLMEngine
from ee_jax.serving.server.app import ServerConfig, create_app


def serve(engine: LLMEngine, config: ServerConfig | None = None) -> None:
    """Serve until interrupted (Ctrl-C): uvicorn lets open streams finish for up to 30 s,
    then the engine thread aborts what is left."""
    config = config or ServerConfig()
    app = create_app(engine, config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level,
                timeout_graceful_shutdown=30)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """The server in a thread of this process, on a free localhost port by default.

        with BackgroundServer(llm.engine) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, engine: LLMEngine, config: ServerConfig | None = None):
        config = config or ServerConfig(port=0)
        if config.port == 0:
            config = dataclasses.replace(config, port=free_port(config.host))
        self.config = config
        self.app = create_app(engine, config)
        self._server = uvicorn.Server(uvicorn.Config(
            self.app, host=config.host, port=config.port, log_level=config.log_level,
            timeout_graceful_shutdown=10))
        self._thread = threading.Thread(target=self._server.run, name="ee-jax-server",
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

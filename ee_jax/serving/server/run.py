"""Running the app: in the foreground (`ee-jax serve`) or in a background thread (tests,
notebooks). Either listens before the engine is ready: the socket is bound first (a port in
use is an OSError at once, not after minutes of loading), then the app answers /health while
its `Startup` builds and warms up the engine."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time

import uvicorn

from ee_jax.serving.engine import LLMEngine
from ee_jax.serving.server.app import ServerConfig, create_app
from ee_jax.serving.server.startup import Startup


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and listening (port 0: a free one; read it back with
    `getsockname`). Raises OSError (address in use, no such address) before anything slow."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def serve(source: LLMEngine | Startup, config: ServerConfig | None = None,
          sock: socket.socket | None = None) -> None:
    """Serve until interrupted (Ctrl-C): uvicorn lets open streams finish for up to 30 s,
    then the engine thread aborts what is left. `sock`: already listening (`listen`), else
    bound here."""
    config = config or ServerConfig()
    sock = sock or listen(config.host, config.port)
    app = create_app(source, config)
    server = uvicorn.Server(_uvicorn_config(app, config, graceful_s=30))
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the Ctrl-C it handled
        server.run(sockets=[sock])


def _uvicorn_config(app, config: ServerConfig, graceful_s: float) -> uvicorn.Config:
    """The one place a ServerConfig becomes uvicorn's settings (`serve` and
    `BackgroundServer`); graceful_s: how long open streams may finish on shutdown."""
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                          timeout_keep_alive=config.keep_alive,
                          timeout_graceful_shutdown=graceful_s)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """The server in a thread of this process, on a free localhost port by default.

        with BackgroundServer(llm.engine) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")

    `start` returns once the server listens; with a `Startup` (an engine still being built)
    that is before it serves: `server.startup.wait()` waits for that.
    """

    def __init__(self, source: LLMEngine | Startup, config: ServerConfig | None = None):
        config = config or ServerConfig(port=0)
        self._sock = listen(config.host, config.port)
        if config.port == 0:
            config = dataclasses.replace(config, port=self._sock.getsockname()[1])
        self.config = config
        self.startup = source if isinstance(source, Startup) else Startup(source)
        try:
            self.app = create_app(self.startup, config)
        except BaseException:
            self._sock.close()
            raise
        self._server = uvicorn.Server(_uvicorn_config(self.app, config, graceful_s=10))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="ee-jax-server", daemon=True)

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

    @property
    def running(self) -> bool:
        """The server's thread is alive (until `stop` has shut it down)."""
        return self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

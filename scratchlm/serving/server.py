"""The uvicorn server around the engine and the app, and its stop.

uvicorn catches Ctrl-C (SIGINT) and SIGTERM, stops accepting connections, waits for the open ones to close and
then re-raises the signal, which the command line turns into its usual exit (130 or 143). Before it waits, the
engine is stopped here: every sequence in flight gets an error (a streamed response ends with an error event,
a plain one gets a 503), so the open connections close at once and no generation is left running.
"""

from __future__ import annotations

from types import FrameType

import uvicorn

from scratchlm.serving.api import create_app
from scratchlm.serving.engine import Engine
from scratchlm.tokenizer.tokenizer import Tokenizer


class Server(uvicorn.Server):
    """uvicorn's server, which stops the engine as soon as it is asked to exit."""

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Without waiting: the signal may have interrupted the main thread while it holds the engine's
        # (reentrant) lock, which the scheduler thread needs to finish. `serve` waits for it afterwards.
        self.engine.stop("the server is shutting down", wait=False)
        super().handle_exit(sig, frame)


def build_server(
    engine: Engine,
    tokenizer: Tokenizer,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
) -> Server:
    """A server for a started `engine` on `host:port` (port 0: a free one, see `Server.servers`)."""
    app = create_app(engine, tokenizer, model_name, api_key)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5, access_log=False
    )
    return Server(config, engine)

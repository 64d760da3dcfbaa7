"""The uvicorn server around the engine and the app, and its stop.

uvicorn catches Ctrl-C (SIGINT) and SIGTERM, stops accepting connections, waits for the open ones to close and
then re-raises the signal, which the command line turns into its usual exit (130 or 143). Before it waits, the
engine is stopped here: every sequence in flight gets an error (a streamed response ends with an error event,
a plain one gets a 503), so the open connections close at once and no generation is left running.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
from types import FrameType

import uvicorn

from scratchlm.errors import ScratchlmError
from scratchlm.serving.api import create_app
from scratchlm.serving.engine import Engine
from scratchlm.tokenizer.tokenizer import Tokenizer

# How long an idle connection stays open. Longer than clients keep an idle connection for reuse (the `openai`
# client, through httpx: 5 s; a proxy in front: 60 s), so that the client always drops it first: a server
# that closes it at the moment the client sends on it again drops that request ("server disconnected
# without sending a response"), which uvicorn's default of 5 s, equal to httpx's, makes a race.
KEEP_ALIVE_SECONDS = 65


class Server(uvicorn.Server):
    """uvicorn's server, which stops the engine as soon as it is asked to exit."""

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine
        self.stopped_by: str | None = None  # the signal that stopped it (SIGINT: Ctrl-C), for `serve` to say

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Without waiting: the signal may have interrupted the main thread while it holds the engine's
        # (reentrant) lock, which the scheduler thread needs to finish. `serve` waits for it afterwards.
        self.engine.stop("the server is shutting down", wait=False)
        self.stopped_by = signal.Signals(sig).name
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
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        access_log=False,
    )
    return Server(config, engine)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port` and listening, for `Server.run(sockets=[...])`: bound before the model
    loads and anything is announced, so that a port in use or an unknown host is a one-line error, not a
    page address followed by uvicorn's."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise ScratchlmError(f"--host {host}: {e.strerror}") from None
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        hint = "; choose another --port (0: any free one)" if e.errno == errno.EADDRINUSE else ""
        reason = os.strerror(e.errno) if e.errno else str(e)  # create_server adds the address to strerror
        raise ScratchlmError(f"cannot listen on {host}:{port}: {reason.lower()}{hint}") from None

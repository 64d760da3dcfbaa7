"""Dataset downloads against a local HTTP server on 127.0.0.1 (never the internet).

The server serves generated files, honours `Range: bytes=N-` with `206` + `Content-Range` (unless told to
ignore ranges), and can cut a transfer after a given number of bytes, so that resuming is tested on a real
socket. It runs in a daemon thread, every connection has a timeout, and it is shut down after each test.
"""

from __future__ import annotations

import gzip
import http.server
import os
import re
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import scratchlm
from scratchlm.cli import main
from scratchlm.data.download import DATASETS, download_dataset, download_file
from scratchlm.errors import ScratchlmError


@dataclass
class ServerState:
    files: dict[str, bytes] = field(default_factory=dict)
    cut_after: int | None = None  # close the connection after sending this many body bytes...
    cuts_left: int = 0  # ...in this many responses
    ignore_range: bool = False
    types: dict[str, str] = field(default_factory=dict)  # Content-Type to send, by path
    requests: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Range header)
    agents: list[str | None] = field(default_factory=list)  # User-Agent header, by request


class Handler(http.server.BaseHTTPRequestHandler):
    state: ServerState
    timeout = 5

    def do_GET(self) -> None:
        state = self.state
        range_header = self.headers.get("Range")
        state.requests.append((self.path, range_header))
        state.agents.append(self.headers.get("User-Agent"))
        body = state.files.get(self.path)
        if body is None:
            self.send_error(404, "Not Found")
            return
        match = re.fullmatch(r"bytes=(\d+)-", range_header or "")
        if match and not state.ignore_range:
            start = int(match.group(1))
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
            payload = body[start:]
        else:
            self.send_response(200)
            payload = body
        if self.path in state.types:
            self.send_header("Content-Type", state.types[self.path])
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if state.cuts_left and state.cut_after is not None:
            state.cuts_left -= 1
            self.wfile.write(payload[: state.cut_after])
            self.close_connection = True
            return
        self.wfile.write(payload)

    def log_message(self, format: str, *args: object) -> None:  # keep test output clean
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, ServerState]]:
    state = ServerState()
    handler = type("BoundHandler", (Handler,), {"state": state})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def random_bytes(n: int, seed: int = 0) -> bytes:
    return bytes((i * 7919 + seed * 104729 + (i >> 8) * 31) % 251 for i in range(n))


def test_plain_download(server, tmp_path):
    base, state = server
    state.files["/f.bin"] = data = random_bytes(300_000)
    path = download_file(f"{base}/f.bin", tmp_path / "f.bin")
    assert path.read_bytes() == data
    assert not (tmp_path / "f.bin.part").exists()
    assert state.requests == [("/f.bin", None)]


def test_requests_name_scratchlm_and_its_version(server, tmp_path):
    """The User-Agent carries the version pyproject.toml declares, which `scratchlm.__version__` states too."""
    base, state = server
    state.files["/f.bin"] = b"x"
    download_file(f"{base}/f.bin", tmp_path / "f.bin")
    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]
    assert state.agents == [f"scratchlm/{declared}"] and scratchlm.__version__ == declared


def test_interrupted_download_resumes_with_range(server, tmp_path):
    base, state = server
    state.files["/f.bin"] = data = random_bytes(300_000, seed=1)
    state.cut_after, state.cuts_left = 100_000, 1
    dest = tmp_path / "f.bin"
    with pytest.raises(ScratchlmError, match="received 100,000 of 300,000 bytes"):
        download_file(f"{base}/f.bin", dest, attempts=1)
    assert not dest.exists()  # never a partial file under the final name
    assert (tmp_path / "f.bin.part").read_bytes() == data[:100_000]

    download_file(f"{base}/f.bin", dest, attempts=1)
    assert dest.read_bytes() == data
    assert state.requests[-1] == ("/f.bin", "bytes=100000-")
    assert not (tmp_path / "f.bin.part").exists()


def test_retries_resume_within_one_call(server, tmp_path):
    base, state = server
    state.files["/f.bin"] = data = random_bytes(250_000, seed=2)
    state.cut_after, state.cuts_left = 60_000, 2
    download_file(f"{base}/f.bin", tmp_path / "f.bin", attempts=3)
    assert (tmp_path / "f.bin").read_bytes() == data
    assert [r for _, r in state.requests] == [None, "bytes=60000-", "bytes=120000-"]


def test_server_ignoring_range_restarts_cleanly(server, tmp_path):
    base, state = server
    state.files["/f.bin"] = data = random_bytes(200_000, seed=3)
    state.ignore_range = True
    (tmp_path / "f.bin.part").write_bytes(b"x" * 50_000)  # a partial download the server will not continue
    download_file(f"{base}/f.bin", tmp_path / "f.bin")
    assert (tmp_path / "f.bin").read_bytes() == data
    assert state.requests == [("/f.bin", "bytes=50000-")]


def test_complete_part_file_is_finished_without_refetching(server, tmp_path):
    base, state = server
    state.files["/f.bin"] = data = random_bytes(10_000, seed=4)
    (tmp_path / "f.bin.part").write_bytes(data)  # interrupted after the last byte, before the rename
    download_file(f"{base}/f.bin", tmp_path / "f.bin")
    assert (tmp_path / "f.bin").read_bytes() == data
    assert state.requests == [("/f.bin", "bytes=10000-")]  # answered 416 with the total size


def test_stale_part_file_longer_than_remote_is_discarded(server, tmp_path):
    base, state = server
    state.files["/f.bin"] = data = random_bytes(10_000, seed=5)
    (tmp_path / "f.bin.part").write_bytes(b"y" * 20_000)
    download_file(f"{base}/f.bin", tmp_path / "f.bin")
    assert (tmp_path / "f.bin").read_bytes() == data


def test_http_error_is_one_clear_error(server, tmp_path):
    base, _ = server
    with pytest.raises(ScratchlmError, match=r"missing\.bin: HTTP 404"):
        download_file(f"{base}/missing.bin", tmp_path / "missing.bin")
    assert not (tmp_path / "missing.bin").exists()


def test_unreachable_server(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on: bind, then close before connecting
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ScratchlmError, match=f"cannot reach 127.0.0.1:{port}"):
        download_file(f"http://127.0.0.1:{port}/f.bin", tmp_path / "f.bin", timeout=5)


def serve_dataset(state: ServerState, name: str, contents: list[bytes]) -> None:
    for remote, content in zip(DATASETS[name], contents, strict=True):
        state.files[f"/{remote.path}"] = gzip.compress(content) if remote.compressed else content


def test_owt_sample_is_decompressed_and_rerun_skips(server, tmp_path):
    base, state = server
    train, valid = random_bytes(400_000, seed=6), b"valid text\n" * 1000
    serve_dataset(state, "owt-sample", [train, valid])
    paths = download_dataset("owt-sample", tmp_path, base_url=base)
    assert [p.name for p in paths] == ["owt_train.txt", "owt_valid.txt"]
    assert paths[0].read_bytes() == train and paths[1].read_bytes() == valid
    assert sorted(os.listdir(tmp_path)) == ["owt_train.txt", "owt_valid.txt"]  # no .gz, .part or temp files

    count = len(state.requests)
    download_dataset("owt-sample", tmp_path, base_url=base)
    assert len(state.requests) == count


def test_interrupted_gzip_download_resumes_then_decompresses(server, tmp_path):
    base, state = server
    train, valid = random_bytes(300_000, seed=7), b"v" * 100
    serve_dataset(state, "owt-sample", [train, valid])
    state.cut_after, state.cuts_left = 1_000, 1
    with pytest.raises(ScratchlmError, match="run the command again to resume"):
        download_dataset("owt-sample", tmp_path, base_url=base, attempts=1)
    assert not (tmp_path / "owt_train.txt").exists()
    download_dataset("owt-sample", tmp_path, base_url=base, attempts=1)
    assert (tmp_path / "owt_train.txt").read_bytes() == train


def test_corrupt_gzip_is_removed_with_a_clear_error(server, tmp_path):
    base, state = server
    serve_dataset(state, "owt-sample", [b"a", b"b"])
    good = gzip.compress(b"the real content " * 1000)
    state.files[f"/{DATASETS['owt-sample'][0].path}"] = good[:-8] + b"\0" * 8  # wrong CRC-32 and length
    with pytest.raises(ScratchlmError, match="not a valid gzip file"):
        download_dataset("owt-sample", tmp_path, base_url=base)
    assert sorted(os.listdir(tmp_path)) == []


def test_tinystories_urls_are_the_specifications(server, tmp_path):
    base, state = server
    serve_dataset(state, "tinystories", [b"Once upon a time.", b"The end."])
    download_dataset("tinystories", tmp_path, base_url=base)
    assert [path for path, _ in state.requests] == [
        "/datasets/roneneldan/TinyStories/resolve/main/TinyStoriesV2-GPT4-train.txt",
        "/datasets/roneneldan/TinyStories/resolve/main/TinyStoriesV2-GPT4-valid.txt",
    ]
    assert (tmp_path / "TinyStoriesV2-GPT4-valid.txt").read_bytes() == b"The end."


def test_cli_download_and_its_errors(server, tmp_path, capsys):
    base, state = server
    serve_dataset(state, "tinystories", [b"train", b"valid"])
    assert main(["download", "tinystories", "--dir", str(tmp_path), "--base-url", base]) == 0
    assert (tmp_path / "TinyStoriesV2-GPT4-train.txt").read_bytes() == b"train"

    state.files.clear()
    capsys.readouterr()
    assert main(["download", "tinystories", "--dir", str(tmp_path / "other"), "--base-url", base]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().count("\n") == 0 and "HTTP 404" in err


HTML_PAGE = (
    b"<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body>Sign in to continue</body></html>\n"
)


@pytest.mark.parametrize(
    ("body", "content_type", "message"),
    [
        (HTML_PAGE, "text/html; charset=utf-8", "sent a web page"),
        (HTML_PAGE, "text/plain", "sent a web page"),  # an error page served as the file's type
        (b"", "text/plain", "sent an empty file"),
    ],
    ids=["html", "html as text", "empty"],
)
def test_a_wrong_body_is_never_saved_as_the_file(server, tmp_path, body, content_type, message):
    base, state = server
    state.files["/f.txt"], state.types["/f.txt"] = body, content_type
    with pytest.raises(ScratchlmError, match=f"{message}.*nothing was saved"):
        download_file(f"{base}/f.txt", tmp_path / "f.txt")
    assert os.listdir(tmp_path) == []


def test_a_gz_download_that_is_not_gzip_is_refused_before_it_is_written(server, tmp_path):
    base, state = server
    serve_dataset(state, "owt-sample", [b"train", b"valid"])
    state.files[f"/{DATASETS['owt-sample'][0].path}"] = HTML_PAGE.replace(b"<!DOCTYPE html>", b"Not found")
    with pytest.raises(ScratchlmError, match="does not start like a gzip file"):
        download_dataset("owt-sample", tmp_path, base_url=base)
    assert os.listdir(tmp_path) == []


def test_a_resumed_download_keeps_its_part_file_when_the_server_turns_to_html(server, tmp_path):
    base, state = server
    state.files["/f.bin"] = data = random_bytes(20_000, seed=8)
    state.cut_after, state.cuts_left = 5_000, 1
    with pytest.raises(ScratchlmError, match="run the command again"):
        download_file(f"{base}/f.bin", tmp_path / "f.bin", attempts=1)
    state.files["/f.bin"], state.types["/f.bin"], state.ignore_range = HTML_PAGE, "text/html", True
    with pytest.raises(ScratchlmError, match="sent a web page"):
        download_file(f"{base}/f.bin", tmp_path / "f.bin", attempts=1)
    assert (tmp_path / "f.bin.part").read_bytes() == data[:5_000]  # what arrived before is kept

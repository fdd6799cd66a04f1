"""A stand-in HTTP server for tests: stdlib ThreadingHTTPServer on 127.0.0.1 at a free port (port 0), answering with
a function the test gives, and stopped on every path out of the block (an assertion, an exception, a timeout)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = Callable[[str, str, Any, dict[str, str]], tuple[int, Any, dict[str, str]]]
"""(method, path, JSON body or None, request headers) -> (status, JSON body, extra response headers)."""


@contextlib.contextmanager
def canned_server(answer: Answer) -> Iterator[str]:
    """The base URL (`http://127.0.0.1:PORT/v1`) of a server answering every GET and POST with ANSWER."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.loads(raw) if raw else None
            status, reply, headers = answer(self.command, self.path, body, dict(self.headers))
            self.send_response(status)
            for key, value in {"Content-Type": "application/json", **headers}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(json.dumps(reply).encode())

        do_GET = do_POST = _answer

        def log_message(self, *args):  # quiet: pytest shows what the assertions say
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    # serve_forever's default poll of 0.5 s is how long shutdown() waits for it: every test paid it once
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)

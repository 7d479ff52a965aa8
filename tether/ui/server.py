"""`tether ui`: binding, the token, routing and refusing, over the standard library's HTTP server."""

from __future__ import annotations

import hmac
import http.cookies
import os
import secrets
import sys
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import parse_qs, unquote, urlsplit

from tether.errors import ConfigError
from tether.pipelines.session import Session
from tether.ui import pages
from tether.ui.catalog import Catalog

LOOPBACK = ("127.0.0.1", "localhost")
MAX_BODY = 4096  # a Check form sends nothing; anything bigger is not ours
HEADERS = {
    "Content-Type": "text/html; charset=utf-8",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # the token is in the first URL: never send it elsewhere
    # No script at all, styles and forms of this page only: escaping is the rule, this is the second wall.
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
}


def address(variables: dict[str, str]) -> tuple[str, int]:
    """`host=` (default 127.0.0.1) and `port=` (default 0: any free port), checked."""
    host, word = variables.get("host") or "127.0.0.1", str(variables.get("port") or "0")
    if not word.isdigit() or int(word) > 65535:
        raise ConfigError(f"port={word}: give a port number from 1 to 65535, or 0 for any free one")
    return host, int(word)


class Server(ThreadingHTTPServer):
    """The page's server: its catalog, its token and the project's name."""

    daemon_threads = True  # Ctrl-C must not wait for a browser's idle keep-alive connection

    def __init__(self, where: tuple[str, int], catalog: Catalog, project: str, token: str) -> None:
        self.catalog, self.project, self.token = catalog, project, token
        super().__init__(where, Handler)

    @property
    def url(self) -> str:
        """Where to point a browser, token included."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/?token={self.token}"

    @property
    def cookie(self) -> str:
        """The cookie's name: one per port, so two pages on one machine keep their own tokens."""
        return f"tether_ui_{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    """GET of the pages and POST of a Check; everything else is refused. Every request needs the token."""

    server: Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        """The runs page, or a run's page."""
        self._handle(post=False)

    def do_POST(self) -> None:
        """A backend's Check: the only request that runs anything, and that only reads."""
        self._handle(post=True)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the request line carries the token, and a terminal of lines per refresh helps nobody."""

    def _handle(self, post: bool) -> None:
        try:
            self._route(post)
        except Exception:  # a bug: the browser gets one line, the terminal the traceback
            traceback.print_exc()
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, pages.message_page(500, "tether ui failed on this request: "
                                                                          "see its terminal"))

    def _route(self, post: bool) -> None:
        parts = urlsplit(self.path)
        given = self._token(parts.query)
        if given is None:
            self._send(HTTPStatus.FORBIDDEN, pages.message_page(403, "the token is missing or wrong: open the "
                                                                     "URL `tether ui` printed"))
            return
        if post and not self._body_read():
            return
        path, catalog = parts.path, self.server.catalog
        if not post and path == "/":
            html = pages.runs_page(self.server.project, catalog.backends, catalog.rows(), catalog.sweeps(),
                                   catalog.refresh_s)
            self._send(HTTPStatus.OK, html, given)
        elif not post and path.startswith("/run/"):
            detail = catalog.detail(unquote(path[len("/run/"):]))  # checked there: a known, valid id or None
            self._found(detail and pages.run_page(detail, catalog.refresh_s), given)
        elif post and path.startswith("/check/"):
            name = unquote(path[len("/check/"):])
            text = catalog.check(name) if name in catalog.backends else None
            self._found(text and pages.check_page(name, text), given)
        else:
            self._found(None, given)

    def _token(self, query: str) -> Optional[str]:
        """'query' or 'cookie' for the way the right token came, None when it did not."""
        wanted = self.server.token.encode()
        for value in parse_qs(query).get("token", []):
            if hmac.compare_digest(value.encode(), wanted):
                return "query"
        try:
            morsel = http.cookies.SimpleCookie(self.headers.get("Cookie", "")).get(self.server.cookie)
        except http.cookies.CookieError:
            return None
        if morsel is not None and hmac.compare_digest(morsel.value.encode(), wanted):
            return "cookie"
        return None

    def _body_read(self) -> bool:
        """Read (and ignore) a POST's small body, so the connection stays in step; False after a refusal."""
        length = self.headers.get("Content-Length", "0")
        if not length.isdigit() or int(length) > MAX_BODY:
            self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, pages.message_page(413, "a Check sends no data"))
            return False
        self.rfile.read(int(length))
        return True

    def _found(self, html: Optional[str], given: str) -> None:
        if html is None:
            self._send(HTTPStatus.NOT_FOUND, pages.message_page(404, "no such run or backend in this project"))
        else:
            self._send(HTTPStatus.OK, html, given)

    def _send(self, status: HTTPStatus, html: str, given: str = "") -> None:
        data = html.encode()
        self.send_response(status)
        for name, value in HEADERS.items():
            self.send_header(name, value)
        if given == "query":  # the first good request: later ones (links, the Check form) carry the cookie
            self.send_header("Set-Cookie", f"{self.server.cookie}={self.server.token}; Path=/; HttpOnly; "
                                           f"SameSite=Strict")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def bind(s: Session) -> Server:
    """The server of `s`'s project at `host=`/`port=`, not serving yet; a one-line error when it cannot listen."""
    host, port = address(s.variables)
    catalog = Catalog.open(s)
    project = os.path.basename(os.path.dirname(s.state_dir)) or "/"
    try:
        return Server((host, port), catalog, project, secrets.token_urlsafe(24))
    except OSError as err:
        raise ConfigError(f"tether ui cannot listen on {host}:{port} ({err.strerror or err}): "
                          f"choose another port=N, or port=0 for any free one") from None


def ui(s: Session) -> str:
    """Serve the page of runs until Ctrl-C, saying its URL first."""
    server = bind(s)
    if server.server_address[0] not in LOOPBACK:
        print(f"tether ui: warning: listening on {server.server_address[0]}, not on 127.0.0.1: anyone who can "
              f"reach it and has the token sees the runs", file=sys.stderr)
    print(f"tether ui: {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return "tether ui: stopped"

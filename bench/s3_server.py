"""A local S3 server for the tests and benchmarks: moto's S3 API on 127.0.0.1, its requests
counted by kind at the server, each delayed by a chosen latency.

:class:`S3Server` serves moto's WSGI application (the one ``moto.server`` runs) on a port the
operating system picks (read back, never guessed), behind :class:`RequestCounter`, a WSGI
middleware that classifies every request (:func:`request_kind`) and can sleep before
answering it (an object store's round trip). :meth:`S3Server.storage_options` are the s3fs
options that reach it. Stopped by the object that started it (:meth:`S3Server.stop`).
"""
import collections
import threading
import time
import urllib.parse
import uuid

__all__ = ["S3Server", "RequestCounter", "request_kind", "REQUEST_KINDS"]

# PUT: an object written in one request (or one part of a multipart upload); POST: the
# start or completion of a multipart upload; DELETE counts a batch delete once.
REQUEST_KINDS = ("PUT", "GET", "HEAD", "LIST", "DELETE", "COPY", "POST")


def request_kind(method, path, query, headers):
    """The kind (one of :data:`REQUEST_KINDS`) of an S3 request to a path-style endpoint:
    ``path`` ``/bucket[/key]``, ``query`` the raw query string, ``headers`` a mapping of
    lower-case names."""
    params = urllib.parse.parse_qs(query, keep_blank_values=True)
    has_key = "/" in path.strip("/")
    if method == "GET":
        return "GET" if has_key else "LIST"
    if method == "PUT":
        return "COPY" if "x-amz-copy-source" in headers else "PUT"
    if method == "POST":
        return "DELETE" if "delete" in params else "POST"
    return method  # HEAD, DELETE


class RequestCounter:
    """WSGI middleware: counts requests by kind (:attr:`counts`, a Counter, thread-safe to
    read through :meth:`snapshot`) and sleeps :attr:`latency_s` before passing each on."""

    def __init__(self, app):
        self.app = app
        self.latency_s = 0.0
        self._lock = threading.Lock()
        self.counts = collections.Counter()
        self.requests = None  # a list: every request's (kind, path) is kept there too

    def __call__(self, environ, start_response):
        headers = {k[5:].replace("_", "-").lower(): v for k, v in environ.items() if k.startswith("HTTP_")}
        kind = request_kind(environ["REQUEST_METHOD"], environ.get("PATH_INFO", "/"),
                            environ.get("QUERY_STRING", ""), headers)
        with self._lock:
            self.counts[kind] += 1
            if self.requests is not None:
                self.requests.append((kind, environ.get("PATH_INFO", "/") + "?" + environ.get("QUERY_STRING", "")))
        if self.latency_s:
            time.sleep(self.latency_s)  # the round trip of a remote store, not synchronisation
        return self.app(environ, start_response)

    def snapshot(self):
        """The counts so far, as a plain dict."""
        with self._lock:
            return dict(self.counts)

    def reset(self):
        with self._lock:
            self.counts.clear()


class S3Server:
    """moto's S3 server on 127.0.0.1 and a port of the system's choosing; :meth:`start` it,
    :meth:`stop` it (the thread it started ends)."""

    def __init__(self):
        self._server = None
        self._thread = None
        self.counter = None
        self.endpoint_url = None

    def start(self):
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import WSGIRequestHandler, make_server

        class QuietHandler(WSGIRequestHandler):
            def log_request(self, *args, **kwargs):  # a line per request would drown the output
                pass

        self.counter = RequestCounter(DomainDispatcherApplication(create_backend_app))
        self._server = make_server("127.0.0.1", 0, self.counter, threaded=True, request_handler=QuietHandler)
        host, port = self._server.server_address[:2]
        self.endpoint_url = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="moto-s3", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        if self._server is not None:
            self._server.shutdown()
            self._thread.join()
            self._server.server_close()
            self._server = None

    def storage_options(self):
        """s3fs options reaching this server (dummy credentials; a fixed region)."""
        return {"key": "testing", "secret": "testing", "endpoint_url": self.endpoint_url,
                "client_kwargs": {"region_name": "eu-west-1"}}

    def environment(self):
        """Environment variables that make s3fs (botocore) reach this server with no options."""
        return {"AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "eu-west-1"}

    def new_bucket(self, prefix="statecore"):
        """A new empty bucket's name."""
        import s3fs

        name = f"{prefix}-{uuid.uuid4().hex[:16]}"
        fs = s3fs.S3FileSystem(**self.storage_options(), skip_instance_cache=True)
        fs.mkdir(name)
        return name

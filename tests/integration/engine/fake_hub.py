"""A Hugging Face Hub on a loopback port, serving local folders as model repositories, so that
`huggingface_hub` itself downloads them into its cache (the layout it reads offline) with no
network: the endpoints snapshot_download uses (repo info, file tree, file HEAD and GET)."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self, repos: dict[str, Path]):
        self.repos = repos
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _files(self, repo: str) -> dict[str, bytes]:
        folder = self.repos[repo]
        return {
            str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(handler.path).path)
        self.requests.append(f"{handler.command} {path}")
        for repo in self.repos:
            files = self._files(repo)
            if path.startswith(f"/api/models/{repo}/revision/"):
                return self._json(
                    handler,
                    {
                        "id": repo,
                        "modelId": repo,
                        "sha": COMMIT,
                        "private": False,
                        "siblings": [{"rfilename": name} for name in files],
                    },
                    body,
                )
            if path.startswith(f"/api/models/{repo}/tree/"):
                return self._json(
                    handler, [self._entry(name, data) for name, data in files.items()], body
                )
            prefix = f"/{repo}/resolve/"
            if path.startswith(prefix):
                name = path[len(prefix) :].split("/", 1)[1]
                if name not in files:
                    return self._error(handler, 404, "EntryNotFound", body)
                data = files[name]
                entry = self._entry(name, data)
                etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
                handler.send_response(200)
                handler.send_header("X-Repo-Commit", COMMIT)
                handler.send_header("ETag", f'"{etag}"')
                if "lfs" in entry:
                    handler.send_header("X-Linked-Etag", f'"{etag}"')
                    handler.send_header("X-Linked-Size", str(len(data)))
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                if body:
                    handler.wfile.write(data)
                return None
        return self._error(handler, 404, "RepoNotFound", body)

    @staticmethod
    def _entry(name: str, data: bytes) -> dict:
        entry = {"type": "file", "path": name, "size": len(data), "oid": _git_blob_id(data)}
        if name.endswith(".safetensors"):
            entry["lfs"] = {
                "oid": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "pointerSize": 134,
            }
        return entry

    @staticmethod
    def _json(handler: BaseHTTPRequestHandler, payload: object, body: bool) -> None:
        data = json.dumps(payload).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)

    @staticmethod
    def _error(handler: BaseHTTPRequestHandler, status: int, code: str, body: bool) -> None:
        data = json.dumps({"error": code}).encode()
        handler.send_response(status)
        handler.send_header("X-Error-Code", code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)

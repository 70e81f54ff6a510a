"""A Hugging Face Hub on loopback: the part of the Hub's HTTP API that `huggingface_hub` uses to create a
repository, push a commit (`create_commit` / `upload_folder`: preupload, the LFS batch API and basic PUT
uploads, the ndjson commit) and download files (`hf_hub_download`, `snapshot_download`, `from_pretrained`).

It stores what arrives (LFS blobs by sha256, regular files inline), keeps every commit (a commit applies
entirely or not at all, as on the Hub), records every request, checks a bearer token, and can be told to fail
a route (`fail("commit", 503)`). Run it with `with HubServer(token=...) as hub:`; point `huggingface_hub`
at `hub.url` (`HF_ENDPOINT`) with `HF_HUB_DISABLE_XET=1` (it speaks LFS, not the Xet protocol).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".onnx", ".pt", ".pth", ".npy", ".model")  # from the Hub's .gitattributes
LFS_MIN_SIZE = 10 * 2**20  # the Hub stores larger files through LFS whatever their name


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Entry:
    size: int
    oid: str  # git sha1 of a regular file; sha256 of an LFS file
    lfs: bool
    data_key: str  # key in HubServer.blobs


@dataclass
class Repo:
    private: bool
    refs: dict = field(default_factory=dict)  # branch or refs/pr/N -> commit sha
    commits: dict = field(default_factory=dict)  # sha -> {"parent", "files": {path: Entry}, "message"}
    prs: int = 0
    lfs: set = field(default_factory=set)  # LFS objects uploaded to this repository (the Hub keeps them per repo)

    def tree(self, rev: str) -> dict | None:
        sha = self.refs.get(rev, rev)
        c = self.commits.get(sha)
        return None if c is None else c["files"]

    def head(self, rev: str) -> str | None:
        sha = self.refs.get(rev, rev)
        return sha if sha in self.commits else None


class HubServer:
    def __init__(self, token: str | None = None, namespaces: tuple[str, ...] = ("org",)):
        self.token, self.namespaces = token, set(namespaces)
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, bytes] = {}
        self.requests: list[dict] = []
        self.failures: dict[str, list[int]] = {}
        self.cards: list[dict] = []  # front matter of each README.md validated
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def fail(self, route: str, status: int, times: int = 1) -> None:
        """Answer the next `times` requests of `route` (create, info, branch, preupload, batch, upload, commit,
        resolve) with `status`."""
        self.failures.setdefault(route, []).extend([status] * times)

    def files(self, repo: str, rev: str = "main") -> dict[str, bytes]:
        """{path: content} of `repo` at `rev`."""
        tree = self.repos[repo].tree(rev)
        return {p: self.blobs[e.data_key] for p, e in tree.items()}

    def routes(self) -> list[str]:
        return [r["route"] for r in self.requests]


class _Reply(Exception):
    def __init__(self, status: int, body=None, headers: dict | None = None, error_code: str | None = None):
        self.status, self.body, self.headers = status, body, dict(headers or {})
        if error_code:
            self.headers["X-Error-Code"] = error_code
            if body is None:
                self.body = {"error": error_code}


_REPO = r"(?P<repo>[^/]+/[^/]+)"
ROUTES = [
    ("POST", "create", re.compile(r"^/api/repos/create$")),
    ("POST", "validate", re.compile(r"^/api/validate-yaml$")),
    ("GET", "info", re.compile(rf"^/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?$")),
    ("GET", "tree", re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")),
    ("POST", "branch", re.compile(rf"^/api/models/{_REPO}/branch/(?P<rev>[^/]+)$")),
    ("POST", "preupload", re.compile(rf"^/api/models/{_REPO}/preupload/(?P<rev>[^/]+)$")),
    ("POST", "commit", re.compile(rf"^/api/models/{_REPO}/commit/(?P<rev>[^/]+)$")),
    ("POST", "batch", re.compile(rf"^/{_REPO}\.git/info/lfs/objects/batch$")),
    ("PUT", "upload", re.compile(rf"^/lfs-upload/{_REPO}/(?P<oid>[0-9a-f]{{64}})$")),
    ("GET", "resolve", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")),
    ("HEAD", "resolve", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")),
]


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            self._serve("GET")

        def do_HEAD(self):
            self._serve("HEAD")

        def do_POST(self):
            self._serve("POST")

        def do_PUT(self):
            self._serve("PUT")

        def _serve(self, method: str):
            split = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(split.query).items()}
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else b""
            route, match = None, None
            for m, name, pattern in ROUTES:
                found = pattern.match(split.path)
                if m == method and found:
                    route, match = name, found
                    break
            record = {"method": method, "path": split.path, "route": route, "bytes": len(body),
                      "authorization": self.headers.get("Authorization")}
            with hub.lock:
                hub.requests.append(record)
                try:
                    if route is None:
                        raise _Reply(404, {"error": f"no route {method} {split.path}"})
                    queued = hub.failures.get(route)
                    if queued:
                        raise _Reply(queued.pop(0), {"error": f"injected failure of {route}"})
                    args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                    reply = getattr(self, f"_{route}")(args, query, body, method)
                except _Reply as r:
                    reply = r
            self._send(reply, head=method == "HEAD")

        def _send(self, r: _Reply, head: bool):
            body = r.body
            if isinstance(body, (dict, list)):
                data, ctype = json.dumps(body).encode(), "application/json"
            else:
                data, ctype = (body or b""), "application/octet-stream"
            self.send_response(r.status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(r.headers.pop("Content-Length", len(data))))
            for k, v in r.headers.items():
                self.send_header(k, v)
            self.end_headers()
            if not head:
                self.wfile.write(data)

        # -- auth ----------------------------------------------------------------------------------
        def _authorized(self) -> bool:
            return hub.token is None or self.headers.get("Authorization") == f"Bearer {hub.token}"

        def _write_access(self, repo_id: str | None = None) -> None:
            if not self._authorized():
                raise _Reply(401, {"error": "Invalid credentials in Authorization header"})
            if repo_id is not None and repo_id.split("/")[0] not in hub.namespaces:
                raise _Reply(403, {"error": f"You don't have the rights to write to {repo_id}"})

        def _repo(self, repo_id: str, write: bool = False) -> Repo:
            if write:
                self._write_access(repo_id)
            repo = hub.repos.get(repo_id)
            if repo is None or (repo.private and not self._authorized()):
                raise _Reply(404, error_code="RepoNotFound")
            return repo

        # -- routes --------------------------------------------------------------------------------
        def _create(self, args, query, body, method):
            doc = json.loads(body or b"{}")
            repo_id = f"{doc['organization']}/{doc['name']}" if doc.get("organization") else doc["name"]
            self._write_access(repo_id)
            if repo_id in hub.repos:
                raise _Reply(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"})
            repo = Repo(private=bool(doc.get("private")) or doc.get("visibility") == "private")
            sha = _commit_sha(None, {}, "initial commit")
            repo.commits[sha] = {"parent": None, "files": {}, "message": "initial commit"}
            repo.refs["main"] = sha
            hub.repos[repo_id] = repo
            return _Reply(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id})

        def _validate(self, args, query, body, method):
            """The card's YAML front matter must parse into a mapping (the Hub checks more)."""
            import yaml

            content = json.loads(body)["content"]
            meta = content.split("---", 2)[1] if content.startswith("---") else ""
            try:
                doc = yaml.safe_load(meta)
            except yaml.YAMLError as e:
                raise _Reply(400, {"error": f"invalid YAML: {e}"}) from None
            if not isinstance(doc, dict):
                raise _Reply(400, {"error": "the metadata is not a mapping"})
            hub.cards.append(doc)
            return _Reply(200, {"errors": [], "warnings": []})

        def _info(self, args, query, body, method):
            repo = self._repo(args["repo"])
            rev = args.get("rev", "main")
            sha = repo.head(rev)
            if sha is None:
                raise _Reply(404, error_code="RevisionNotFound")
            files = repo.commits[sha]["files"]
            return _Reply(200, {"id": args["repo"], "modelId": args["repo"], "sha": sha, "private": repo.private,
                                "siblings": [{"rfilename": p} for p in sorted(files)]})

        def _tree(self, args, query, body, method):
            repo = self._repo(args["repo"])
            files = repo.tree(args["rev"])
            if files is None:
                raise _Reply(404, error_code="RevisionNotFound")
            prefix = args.get("path", "").strip("/")
            out = []
            for p, e in sorted(files.items()):
                if prefix and not p.startswith(prefix + "/"):
                    continue
                item = {"type": "file", "path": p, "size": e.size,
                        "oid": git_oid(hub.blobs[e.data_key]) if not e.lfs else e.oid}
                if e.lfs:
                    item["lfs"] = {"oid": e.oid, "size": e.size, "pointerSize": 134}
                out.append(item)
            return _Reply(200, out)

        def _branch(self, args, query, body, method):
            repo = self._repo(args["repo"], write=True)
            if args["rev"] in repo.refs:
                raise _Reply(409, {"error": "Reference already exists"})
            repo.refs[args["rev"]] = repo.refs["main"]
            return _Reply(200, {})

        def _preupload(self, args, query, body, method):
            repo = self._repo(args["repo"], write=True)
            files = repo.tree(args["rev"]) or {}
            out = []
            for f in json.loads(body)["files"]:
                lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] >= LFS_MIN_SIZE
                e = files.get(f["path"])
                remote = None if e is None else (e.oid if e.lfs else git_oid(hub.blobs[e.data_key]))
                out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                            "oid": remote})
            return _Reply(200, {"files": out})

        def _batch(self, args, query, body, method):
            repo = self._repo(args["repo"], write=True)
            doc = json.loads(body)
            objects = []
            for o in doc["objects"]:
                item = {"oid": o["oid"], "size": o["size"]}
                if o["oid"] not in repo.lfs:
                    item["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{args['repo']}/{o['oid']}"}}
                objects.append(item)
            return _Reply(200, {"transfer": "basic", "objects": objects})

        def _upload(self, args, query, body, method):  # a presigned URL on the Hub: no Authorization
            if hashlib.sha256(body).hexdigest() != args["oid"]:
                raise _Reply(400, {"error": "sha256 mismatch"})
            hub.blobs[args["oid"]] = body
            hub.repos[args["repo"]].lfs.add(args["oid"])
            return _Reply(200, {})

        def _commit(self, args, query, body, method):
            repo = self._repo(args["repo"], write=True)
            rev = args["rev"]
            parent = repo.head(rev)
            if parent is None:
                raise _Reply(404, error_code="RevisionNotFound")
            lines = [json.loads(x) for x in body.splitlines() if x.strip()]
            header = next(x["value"] for x in lines if x["key"] == "header")
            if header.get("parentCommit") and header["parentCommit"] != parent:
                raise _Reply(412, {"error": "parentCommit is not the head of the branch"})
            files = dict(repo.commits[parent]["files"])
            staged = {}
            for x in lines:
                v = x["value"]
                if x["key"] == "file":
                    data = base64.b64decode(v["content"])
                    key = hashlib.sha256(data).hexdigest()
                    staged[key] = data
                    files[v["path"]] = Entry(len(data), git_oid(data), False, key)
                elif x["key"] == "lfsFile":
                    if v["oid"] not in repo.lfs:
                        raise _Reply(422, {"error": f"LFS object {v['oid']} of {v['path']} was never uploaded"})
                    files[v["path"]] = Entry(v["size"], v["oid"], True, v["oid"])
                elif x["key"] in ("deletedFile", "deletedFolder"):
                    files = {p: e for p, e in files.items() if p != v["path"] and not p.startswith(v["path"] + "/")}
            hub.blobs.update(staged)
            sha = _commit_sha(parent, files, header.get("summary", ""))
            repo.commits[sha] = {"parent": parent, "files": files, "message": header.get("summary")}
            out = {"commitUrl": f"{hub.url}/{args['repo']}/commit/{sha}", "commitOid": sha}
            if query.get("create_pr") == "1":
                repo.prs += 1
                repo.refs[f"refs/pr/{repo.prs}"] = sha
                out["pullRequestUrl"] = f"{hub.url}/{args['repo']}/discussions/{repo.prs}"
            else:
                repo.refs[rev] = sha
            return _Reply(200, out)

        def _resolve(self, args, query, body, method):
            repo = self._repo(args["repo"])
            sha = repo.head(args["rev"])
            if sha is None:
                raise _Reply(404, error_code="RevisionNotFound")
            e = repo.commits[sha]["files"].get(args["path"])
            if e is None:
                raise _Reply(404, error_code="EntryNotFound")
            data = hub.blobs[e.data_key]
            headers = {"X-Repo-Commit": sha, "ETag": f'"{git_oid(data) if not e.lfs else e.oid}"'}
            if e.lfs:
                headers.update({"X-Linked-Etag": f'"{e.oid}"', "X-Linked-Size": str(e.size)})
            return _Reply(200, data, headers)

    return Handler


def _commit_sha(parent, files: dict, message: str) -> str:
    tree = sorted((p, e.oid) for p, e in files.items())
    return hashlib.sha1(json.dumps([parent, tree, message]).encode()).hexdigest()

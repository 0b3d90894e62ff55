"""The documentation site builds offline and every page works in a real browser.

The site is built by `tools/build_docs.py` (nbdev's processed notebooks rendered with nbconvert, no Quarto). Each
page is then opened in headless Chromium (Debian's `chromium` package), driven over the DevTools protocol on a
pipe (`--remote-debugging-pipe`, no extra Python package needed): a page passes when it loads with no JavaScript
exception, no console or network error, and every image has decoded (`naturalWidth > 0`).
"""
import json, os, re, shutil, subprocess, sys, time
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("docs") / "site"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "build_docs.py"), "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"docs build failed:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return out


class _Links(HTMLParser):
    def __init__(self):
        super().__init__(); self.hrefs, self.imgs = [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "a" and a.get("href"): self.hrefs.append(a["href"])
        if tag == "img": self.imgs.append(a.get("src", ""))


def _parse(page):
    p = _Links(); p.feed(page.read_text(encoding="utf-8")); return p


def test_every_notebook_is_a_page(site):
    notebooks = [p for p in (ROOT / "nbs").glob("*.ipynb") if not p.name.startswith("_")]
    pages = {p.name for p in site.glob("*.html")}
    for nb in notebooks:
        name = re.sub(r"^\d+[a-zA-Z0-9]*_", "", nb.stem.lower()) + ".html"
        assert name in pages, f"{nb.name} has no page {name} in {sorted(pages)}"
    assert "api.html" in pages and "index.html" in pages


def test_navigation_and_local_links_resolve(site):
    pages = sorted(site.glob("*.html"))
    for page in pages:
        links = _parse(page)
        for href in links.hrefs:
            if re.match(r"^[a-z]+:", href) or href.startswith("#"): continue  # external or in-page
            target = href.split("#")[0]
            assert (site / target).exists(), f"{page.name} links to missing {href}"
        for src in links.imgs:
            assert src.startswith("data:image/"), f"{page.name} has a non-embedded image {src[:60]}"
    api = (site / "api.html").read_text()
    assert "xtoken_dp." in api


def test_api_reference_anchors_exist(site):
    "Every link of the API page lands on a heading of the target page."
    anchors = {}
    for href in _parse(site / "api.html").hrefs:
        if "#" not in href or re.match(r"^[a-z]+:", href): continue
        page, frag = href.split("#", 1)
        if page not in anchors: anchors[page] = set(re.findall(r'id="([^"]+)"', (site / page).read_text()))
        assert frag in anchors[page], f"api.html links to {href}, which has no such anchor"


class DevTools:
    "A minimal client of Chromium's DevTools protocol over `--remote-debugging-pipe` (NUL-separated JSON)."

    def __init__(self, binary, profile):
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()
        def child_fds():
            os.dup2(to_chrome_r, 3); os.dup2(from_chrome_w, 4)
        args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-extensions", f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"]
        # fds 3 and 4 are where Chromium expects the pipe; they are set up after the fork and kept open
        self.proc = subprocess.Popen(args, pass_fds=(3, 4), preexec_fn=child_fds,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome_r); os.close(from_chrome_w)
        self._buf, self._id, self.events = b"", 0, []

    def _read_message(self, deadline):
        import select
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0: raise TimeoutError("no answer from Chromium")
            ready, _, _ = select.select([self._r], [], [], left)
            if ready:
                chunk = os.read(self._r, 1 << 16)
                if not chunk: raise RuntimeError("Chromium closed the DevTools pipe")
                self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method, params=None, session=None, timeout=30):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session: msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            m = self._read_message(deadline)
            if m.get("id") == self._id:
                if "error" in m: raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def wait_for(self, method, session, timeout=30):
        deadline = time.monotonic() + timeout
        for i, e in enumerate(self.events):
            if e.get("method") == method and e.get("sessionId") == session: return self.events.pop(i)
        while True:
            m = self._read_message(deadline)
            if m.get("method") == method and m.get("sessionId") == session: return m
            self.events.append(m)

    def close(self):
        try: self.send("Browser.close", timeout=5)
        except Exception: pass
        try: self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired: self.proc.kill()
        os.close(self._r); os.close(self._w)


_PROBE = """JSON.stringify({
  images: [...document.images].map(i => ({src: i.src.slice(0, 40), ok: i.complete && i.naturalWidth > 0})),
  title: document.title, headings: document.querySelectorAll('h1, h2, h3').length,
  nav: document.querySelectorAll('nav a').length})"""


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed: `make test` installs it with "
                    "`apt-get install -y chromium` when it runs as root; otherwise install it to run this check")
def test_pages_load_in_chromium(site, tmp_path):
    browser = DevTools(CHROMIUM, tmp_path / "profile")
    try:
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"): browser.send(f"{domain}.enable", session=session)
        pages = sorted(site.glob("*.html"))
        n_images = 0
        for page in pages:
            browser.events.clear()
            browser.send("Page.navigate", {"url": page.as_uri()}, session=session)
            browser.wait_for("Page.loadEventFired", session)
            probe = json.loads(browser.send("Runtime.evaluate", {"expression": _PROBE, "returnByValue": True},
                                            session=session)["result"]["value"])
            problems = [e for e in browser.events if e.get("sessionId") == session and (
                e["method"] == "Runtime.exceptionThrown"
                or (e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")
                or (e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] == "error"))]
            assert not problems, f"{page.name}: {json.dumps(problems)[:2000]}"
            broken = [i for i in probe["images"] if not i["ok"]]
            assert not broken, f"{page.name}: images that did not render: {broken}"
            assert probe["nav"] >= len(pages) and probe["headings"] >= 1, f"{page.name}: {probe}"
            n_images += len(probe["images"])
        assert n_images > 0, "no page of the site shows an image: the plots are missing"
    finally:
        browser.close()

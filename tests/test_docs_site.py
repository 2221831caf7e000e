"""The documentation site in a real browser (Debian's chromium, driven by playwright).

Build the site, then point this test at it (`.ci/run` does both):

    python scripts/build_docs.py _site && FASTAI_DALI_SITE=_site pytest -q tests/test_docs_site.py

Without `FASTAI_DALI_SITE` the test is skipped (so `pytest -q tests` needs no browser). With it, a missing
chromium or playwright is an error. The site is served on 127.0.0.1; every page is loaded and checked for page
errors, console errors, failed requests (or HTTP errors), requests to any other host, images that did not load, and
internal links or anchors that lead nowhere; search must find a public name. Screenshots of the home page and of a
tutorial page (a reference page while there is no tutorial) go to `FASTAI_DALI_SHOTS` (default `_site_shots/`).
"""
import functools, html.parser, http.server, os, re, threading, urllib.error, urllib.parse, urllib.request
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
SITE = os.environ.get('FASTAI_DALI_SITE')
pytestmark = pytest.mark.skipif(not SITE, reason='set FASTAI_DALI_SITE to a site built by scripts/build_docs.py')
CHROMIUM = os.environ.get('FASTAI_DALI_CHROMIUM', '/usr/bin/chromium')
SHOTS = Path(os.environ.get('FASTAI_DALI_SHOTS', ROOT/'_site_shots'))
SEARCH_NAME = 'DaliDataLoaders'

class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a): pass

@pytest.fixture(scope='module')
def server():
    site = Path(SITE).resolve()
    assert (site/'index.html').exists(), f'no site at {site}: run python scripts/build_docs.py {SITE}'
    httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), functools.partial(_Quiet, directory=str(site)))
    th = threading.Thread(target=httpd.serve_forever, daemon=True); th.start()
    yield site, f'http://127.0.0.1:{httpd.server_address[1]}/'
    httpd.shutdown(); httpd.server_close()

class _Ids(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(); self.ids = set()
    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k in ('id', 'name') and v: self.ids.add(v)

@functools.lru_cache(maxsize=None)
def _fetch(url):
    "HTTP status of `url` and, for an HTML page, the ids in it"
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            body = r.read(); ctype = r.headers.get('Content-Type', '')
            status = r.status
    except urllib.error.HTTPError as e: return e.code, frozenset()
    if 'html' not in ctype: return status, frozenset()
    p = _Ids(); p.feed(body.decode('utf-8', 'replace'))
    return status, frozenset(p.ids)

@pytest.fixture(scope='module')
def crawl(server):
    "Load every page in chromium; what went wrong, by kind"
    site, base = server
    from playwright.sync_api import sync_playwright
    assert Path(CHROMIUM).exists(), f'{CHROMIUM} missing: apt-get install -y chromium (or set FASTAI_DALI_CHROMIUM)'
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob('*.html') if p.name != '404.html')
    probs = {k: [] for k in ('page errors', 'console errors', 'failed requests', 'external requests',
                             'missing images', 'broken links')}
    host = urllib.parse.urlsplit(base).netloc
    with sync_playwright() as pw:
        br = pw.chromium.launch(executable_path=CHROMIUM, args=['--no-sandbox'])
        ctx = br.new_context(viewport={'width': 1280, 'height': 900})
        def route(r):
            if urllib.parse.urlsplit(r.request.url).netloc == host or r.request.url.startswith(('data:', 'blob:')):
                r.continue_()
            else:
                probs['external requests'].append(f'{cur[0]}: {r.request.url}'); r.abort()
        cur = ['']
        ctx.route('**/*', route)
        pg = ctx.new_page()
        pg.on('pageerror', lambda e: probs['page errors'].append(f'{cur[0]}: {e}'))
        pg.on('console', lambda m: m.type == 'error' and probs['console errors'].append(f'{cur[0]}: {m.text}'))
        pg.on('requestfailed', lambda r: urllib.parse.urlsplit(r.url).netloc == host and
              probs['failed requests'].append(f'{cur[0]}: {r.url} {r.failure}'))
        pg.on('response', lambda r: r.status >= 400 and probs['failed requests'].append(f'{cur[0]}: {r.url} HTTP {r.status}'))
        for rel in pages:
            cur[0] = rel
            pg.goto(base + rel, wait_until='load')
            pg.wait_for_load_state('networkidle')
            for src in pg.eval_on_selector_all('img', 'els => els.filter(e => !(e.complete && e.naturalWidth > 0)).map(e => e.src)'):
                probs['missing images'].append(f'{rel}: {src}')
            for href in set(pg.eval_on_selector_all('a[href]', 'els => els.map(e => e.href)')):
                u = urllib.parse.urlsplit(href)
                if u.scheme not in ('http', 'https') or u.netloc != host: continue
                status, ids = _fetch(urllib.parse.urlunsplit(u._replace(fragment='')))
                if status >= 400: probs['broken links'].append(f'{rel}: {href} (HTTP {status})')
                elif u.fragment and urllib.parse.unquote(u.fragment) not in ids:
                    probs['broken links'].append(f'{rel}: {href} (no such anchor)')
        br.close()
    return pages, probs

def _check(crawl, kind):
    pages, probs = crawl
    assert len(pages) > 1
    assert not probs[kind], f'{len(probs[kind])} {kind}:\n' + '\n'.join(probs[kind][:50])

def test_pages(crawl):
    pages, _ = crawl
    print(f'\n{len(pages)} pages loaded')
    for p in ('index.html', 'data/index.html', 'troubleshooting/index.html'): assert p in pages

def test_no_page_errors(crawl):      _check(crawl, 'page errors')
def test_no_console_errors(crawl):   _check(crawl, 'console errors')
def test_no_failed_requests(crawl):  _check(crawl, 'failed requests')
def test_no_external_requests(crawl): _check(crawl, 'external requests')
def test_no_missing_images(crawl):   _check(crawl, 'missing images')
def test_no_broken_links(crawl):     _check(crawl, 'broken links')

@pytest.fixture(scope='module')
def page(server):
    from playwright.sync_api import sync_playwright
    site, base = server
    with sync_playwright() as pw:
        br = pw.chromium.launch(executable_path=CHROMIUM, args=['--no-sandbox'])
        pg = br.new_page(viewport={'width': 1280, 'height': 900})
        yield base, pg
        br.close()

def test_search_finds_public_name(page):
    base, pg = page
    pg.goto(base, wait_until='networkidle')
    box = pg.locator('input.md-search__input')
    box.click()
    box.press_sequentially(SEARCH_NAME, delay=20)
    res = pg.locator('.md-search-result__item')
    res.first.wait_for(timeout=20000)
    texts = res.all_inner_texts()
    assert any(SEARCH_NAME in t for t in texts), texts[:5]
    res.first.locator('a.md-search-result__link').first.click()
    pg.wait_for_load_state('load')
    assert SEARCH_NAME in pg.locator('article').inner_text()
    print(f'\nsearch for {SEARCH_NAME}: {len(texts)} results, the first leads to {pg.url}')

def test_screenshots(page, server):
    base, pg = page
    site, _ = server
    SHOTS.mkdir(parents=True, exist_ok=True)
    pg.goto(base, wait_until='networkidle')
    # the first page of the navigation's Tutorials section, else the DaliDataLoaders reference page
    tut = pg.eval_on_selector_all('nav.md-nav--primary li.md-nav__item--section',
        """els => els.filter(e => e.querySelector('label, span, a').textContent.trim() == 'Tutorials')
                    .map(e => e.querySelector('nav a.md-nav__link').href)""")
    for name, url in (('home', base), ('tutorial', tut[0]) if tut else ('reference', base + 'data/')):
        pg.goto(url, wait_until='networkidle')
        fn = SHOTS/f'{name}.png'
        pg.screenshot(path=str(fn))
        assert fn.stat().st_size > 10_000
        print(f'\nscreenshot of {pg.url}: {fn}')

"""The documentation site in a real browser (Debian's chromium, driven by playwright).

Build the site, then point this test at it (`.ci/run` does both):

    python scripts/build_docs.py _site && FASTAI_DALI_SITE=_site pytest -q tests/test_docs_site.py

Without `FASTAI_DALI_SITE` the test is skipped (so `pytest -q tests` needs no browser). With it, a missing
chromium or playwright is an error. The site is served on 127.0.0.1; every page is loaded and checked for page
errors, console errors, failed requests (or HTTP errors), requests to any other host, images that did not load, and
internal links or anchors that lead nowhere; search must find a public name. Layout, at the default viewport
(1280x900) and a phone's (390x844): no code block wider than its box or than the page's column (long lines wrap: no
horizontal scrollbar on code), no letter of code under the code copy button; and no page's text says `NoneType` (an
API signature's `x=None` shown as `x:NoneType=None`). Screenshots of the home page, of a tutorial page and of the
reference page `data/`, each with its code block with the longest line (`NAME_code.png`), and of the home page at 390px
(`home_narrow*.png`) go to `FASTAI_DALI_SHOTS` (default `_site_shots/`).
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

VIEWPORTS = {'default': {'width': 1280, 'height': 900}, 'narrow': {'width': 390, 'height': 844}}

# code blocks (`pre`, its `code`) that scroll sideways or stick out of the page's column; inline code out of the column
# (but not inside a table that scrolls: at 390px the results page's tables do, as mkdocs-material makes them)
_JS_WIDE_CODE = """() => {
  const col = document.querySelector('.md-content').getBoundingClientRect(), out = [];
  const txt = el => JSON.stringify(el.textContent.trim().split('\\n')[0].slice(0, 60));
  for (const el of document.querySelectorAll('.md-content pre, .md-content pre > code')) {
    const r = el.getBoundingClientRect();
    if (el.scrollWidth > el.clientWidth + 1) out.push(`${el.tagName.toLowerCase()} scrolls (${el.scrollWidth} > ${el.clientWidth} px): ${txt(el)}`);
    else if (r.right > col.right + 1 || r.left < col.left - 1) out.push(`${el.tagName.toLowerCase()} outside the column (${Math.round(r.left)}..${Math.round(r.right)} px, column ${Math.round(col.left)}..${Math.round(col.right)}): ${txt(el)}`);
  }
  const scrolls = el => {  // inside a box the reader scrolls sideways (a wide table's wrapper): that box's layout
    for (let a = el.parentElement; a && !a.classList.contains('md-content'); a = a.parentElement)
      if (['auto', 'scroll'].includes(getComputedStyle(a).overflowX)) return true;
    return false;
  };
  for (const el of document.querySelectorAll('.md-content :not(pre) > code')) {
    if (scrolls(el)) continue;
    for (const r of el.getClientRects())
      if (r.width && (r.right > col.right + 1 || r.left < col.left - 1)) { out.push(`inline code outside the column: ${txt(el)}`); break; }
  }
  return out;
}"""

# letters of code under mkdocs-material's copy button: the box around it (`nav.md-code__nav`, with a background;
# `.md-clipboard` in material < 9.6), which its script puts at the top right of each `pre`
_JS_COPY_OVER_TEXT = """() => {
  const out = [], hit = (a, b) => a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
  const btns = document.querySelectorAll('.md-content pre > .md-code__nav, .md-content pre > .md-clipboard');
  for (const btn of btns) {
    const b = btn.getBoundingClientRect(), code = btn.parentElement.querySelector('code');
    if (!b.width || !code) continue;
    const w = document.createTreeWalker(code, NodeFilter.SHOW_TEXT), rg = document.createRange();
    let bad = null;
    for (let n = w.nextNode(); n && !bad; n = w.nextNode()) {
      rg.selectNodeContents(n);
      if (![...rg.getClientRects()].some(r => hit(r, b))) continue;
      for (let i = 0; i < n.length && !bad; i++) {  // this text runs under the button: which letters?
        if (/\\s/.test(n.data[i])) continue;
        rg.setStart(n, i); rg.setEnd(n, i + 1);
        if ([...rg.getClientRects()].some(r => r.width && hit(r, b))) bad = n.data.slice(Math.max(0, i - 20), i + 20);
      }
    }
    if (bad) out.push(`copy button over ${JSON.stringify(bad)}`);
  }
  if (document.querySelector('.md-content pre > code') && !btns.length) out.push('no copy button found (its class changed?)');
  return out;
}"""

@pytest.fixture(scope='module')
def browser():
    "One chromium for the module: playwright's sync API cannot nest, and the tests run in a shuffled order"
    from playwright.sync_api import sync_playwright
    assert Path(CHROMIUM).exists(), f'{CHROMIUM} missing: apt-get install -y chromium (or set FASTAI_DALI_CHROMIUM)'
    with sync_playwright() as pw:
        br = pw.chromium.launch(executable_path=CHROMIUM, args=['--no-sandbox'])
        yield br
        br.close()

@pytest.fixture(scope='module')
def crawl(server, browser):
    "Load every page in chromium; what went wrong, by kind"
    site, base = server
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob('*.html') if p.name != '404.html')
    probs = {k: [] for k in ('page errors', 'console errors', 'failed requests', 'external requests',
                             'missing images', 'broken links', 'wide code', 'copy button over code', 'NoneType')}
    host = urllib.parse.urlsplit(base).netloc
    ctx = browser.new_context(viewport=VIEWPORTS['default'])
    try:
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
            for vp, size in VIEWPORTS.items():
                if vp != 'default': pg.set_viewport_size(size); pg.wait_for_timeout(50)
                probs['wide code'] += [f'{rel} ({vp}): {w}' for w in pg.evaluate(_JS_WIDE_CODE)]
                probs['copy button over code'] += [f'{rel} ({vp}): {w}' for w in pg.evaluate(_JS_COPY_OVER_TEXT)]
            pg.set_viewport_size(VIEWPORTS['default'])
            probs['NoneType'] += [f'{rel}: {l.strip()}' for l in pg.inner_text('body').splitlines() if 'NoneType' in l]
    finally: ctx.close()
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
def test_code_fits(crawl):           _check(crawl, 'wide code')
def test_copy_button_clear(crawl):   _check(crawl, 'copy button over code')
def test_no_nonetype(crawl):         _check(crawl, 'NoneType')

@pytest.fixture(scope='module')
def page(server, browser):
    site, base = server
    pg = browser.new_page(viewport=VIEWPORTS['default'])
    yield base, pg
    pg.close()

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

# the code block with the longest line on the page (where wrapping and the copy button show)
_JS_LONGEST_CODE = """() => [...document.querySelectorAll('.md-content div.highlight')].map(e =>
    [Math.max(...e.textContent.split('\\n').map(l => l.length)), e]).sort((a, b) => b[0] - a[0]).map(x => x[1])[0]"""

def test_screenshots(page, server):
    "the home page, the first tutorial (else the DaliDataLoaders reference page) and the reference page `data/`; for each,\n    `NAME_code.png`, its code block with the longest line; the home page and its code again at 390px (`home_narrow*`)"
    base, pg = page
    site, _ = server
    SHOTS.mkdir(parents=True, exist_ok=True)
    pg.goto(base, wait_until='networkidle')
    tut = pg.eval_on_selector_all('nav.md-nav--primary li.md-nav__item--section',
        """els => els.filter(e => e.querySelector('label, span, a').textContent.trim() == 'Tutorials')
                    .map(e => e.querySelector('nav a.md-nav__link').href)""")
    shots = [('home', base, 'default'), ('tutorial', tut[0], 'default') if tut else None,
             ('reference', base + 'data/', 'default') if (site/'data'/'index.html').exists() else None,
             ('home_narrow', base, 'narrow')]
    for name, url, vp in filter(None, shots):
        pg.set_viewport_size(VIEWPORTS[vp])
        pg.goto(url, wait_until='networkidle')
        fn = SHOTS/f'{name}.png'
        pg.screenshot(path=str(fn))
        assert fn.stat().st_size > 10_000
        print(f'\nscreenshot of {pg.url} ({VIEWPORTS[vp]["width"]}px): {fn}')
        blk = pg.evaluate_handle(_JS_LONGEST_CODE).as_element()
        if blk:
            blk.scroll_into_view_if_needed(); blk.screenshot(path=str(SHOTS/f'{name}_code.png'))
            print(f'screenshot of its code block with the longest line: {SHOTS/f"{name}_code.png"}')
    pg.set_viewport_size(VIEWPORTS['default'])

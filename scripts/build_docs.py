#!/usr/bin/env python3
"""Build the documentation site from the notebooks: `python scripts/build_docs.py [OUT_DIR]` (default `_site`).

Quarto (and so `nbdev_docs`) is not available, so this does what `nbdev_docs` does with other tools:

1. each of `index.ipynb` (the home page) and `nbs/*.ipynb` goes through nbdev's own notebook processors
   (`add_show_docs`, `hide_line`, `rm_header_dash`, `clean_show_doc`, `rm_export`, `hide_`, ...), with nbdev's
   `exec_show_docs` replaced by running the whole notebook with nbclient (DALI's CPU backend on a machine without a
   GPU; kernels over IPC, not TCP), so every output, `show_batch` picture and `dali_report` table is on the page;
2. the processed notebook becomes a Markdown page: code cells as Python blocks (`#|` lines removed; `echo: false`,
   `output: false`, `include: false` honoured), pictures as PNG files, HTML outputs as they are, `show_doc`
   outputs as API entries (heading with an id per name, signature as nbdev shows it (`x=None`, not
   `x:NoneType=None`), docstring, a link to the source line on GitHub);
   backticked public names link to their entry;
3. mkdocs (material theme, no web fonts, no repo widget: the site makes no request outside itself) builds the
   HTML with its search index; code blocks wrap their long lines, clear of the copy button (`docs_site/extra.css`,
   with pymdownx.highlight's `line_spans` for a hanging indent). Navigation: Home, Tutorials (`nbs/1N_*.ipynb`), Guides (`08_troubleshooting`),
   Reference (the rest, in file-name order), each titled by the notebook's first `# ` heading; `docs/results/README.md`
   (the measured results) is a Guides page too.

Options: `--no-exec` keeps the notebooks' saved outputs instead of running them (fast, for layout work);
`--only NAME ...` builds some notebooks only (with index.ipynb). The Markdown sources and the generated
`mkdocs.yml` are written to `_site_src/`.
"""
import argparse, base64, configparser, importlib, inspect, json, os, re, shutil, subprocess, sys, time, warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE_CFG = ROOT/'docs_site'
os.environ['PYTHONPATH'] = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p])
os.environ.setdefault('NO_MKDOCS_2_WARNING', '1')
os.environ.setdefault('PYTHONFAULTHANDLER', '1')  # a notebook's kernel that crashes prints where (on stderr)
sys.path.insert(0, str(ROOT))

_re_tut = re.compile(r'^1\d')
SECTIONS = ('Tutorials', 'Guides', 'Reference')
GUIDES = {'08_troubleshooting'}

def settings():
    cp = configparser.ConfigParser(); cp.read(ROOT/'settings.ini')
    return cp['DEFAULT']

def section(stem):
    if _re_tut.match(stem): return 'Tutorials'
    if stem in GUIDES: return 'Guides'
    return 'Reference'

def page_name(path):
    "`nbs/04_data.ipynb` -> `data.md` (nbdev drops the number prefix too); `index.ipynb` -> `index.md`"
    if path.parent == ROOT: return 'index.md'
    return re.sub(r'^\d+[a-z]*_', '', path.stem) + '.md'

def title_of(path):
    nb = json.loads(path.read_text())
    for c in nb['cells']:
        if c['cell_type'] != 'markdown': continue
        m = re.search(r'^#\s+(\S.*?)\s*$', ''.join(c['source']), flags=re.MULTILINE)
        if m: return m.group(1).replace('`', '')
    return path.stem

def title_of_md(path):
    m = re.search(r'^#\s+(\S.*?)\s*$', path.read_text(), flags=re.MULTILINE)
    return m.group(1) if m else path.stem

def notebooks(only=None):
    nbs = sorted((ROOT/'nbs').glob('*.ipynb'))
    if only: nbs = [p for p in nbs if any(o in p.stem for o in only)]
    return [ROOT/'index.ipynb'] + nbs

# ---------------------------------------------------------------- nbdev's processors, with nbclient running the notebook
_n_kernels = 0
def _kernel_config():
    """Kernels talk to the build over IPC (Unix sockets), not TCP: ipykernel >= 7 warns `Kernel is running over TCP
    without encryption` at every start over TCP (jupyter_client's default transport, without CurveZMQ keys), once per
    notebook. The sockets get an absolute name in jupyter's runtime directory (private to the user; jupyter_client
    removes them when the kernel stops): the default name is relative to each process's working directory, and a
    kernel runs in its notebook's folder. Windows has no IPC: TCP there."""
    global _n_kernels
    from traitlets.config import Config
    from jupyter_core.paths import jupyter_runtime_dir
    cfg = Config()
    if os.name == 'posix':
        rt = jupyter_runtime_dir(); os.makedirs(rt, mode=0o700, exist_ok=True)
        _n_kernels += 1
        ip = os.path.join(rt, f'fastai-dali-docs-{os.getpid()}-{_n_kernels}-ipc')
        if len(ip) < 95:  # a Unix socket's name is at most 107 bytes (ip + '-PORT')
            cfg.KernelManager.transport, cfg.KernelManager.ip = 'ipc', ip
    return cfg

def _exec_proc(path, execute, timeout):
    from nbdev.process import Processor
    from fastcore.xtras import dict2obj
    import nbformat
    from nbclient import NotebookClient
    skip_flags = set(settings().get('tst_flags', '').split())

    class exec_nbclient(Processor):
        "Run every cell with nbclient, as `nbdev_test` would (skipping `eval: false` and `tst_flags` cells); keep the outputs"
        def begin(self):
            if not execute: return
            cells = [nbformat.v4.new_code_cell('from nbdev.showdoc import show_doc')]
            for c in self.nb.cells:
                src = c.get('source') or ''
                if c.cell_type != 'code':
                    cells.append(nbformat.v4.new_markdown_cell('')); continue
                nc = nbformat.v4.new_code_cell(src)
                d = getattr(c, 'directives_', {}) or {}
                if (d.get('eval:', [''])[0].lower() == 'false') or (skip_flags & set(d)):
                    nc.metadata['tags'] = ['skip-execution']
                cells.append(nc)
            nb = nbformat.v4.new_notebook(cells=cells, metadata={'kernelspec': {'name': 'python3', 'display_name': 'Python 3', 'language': 'python'}})
            client = NotebookClient(nb, timeout=timeout, kernel_name='python3', resources={'metadata': {'path': str(path.parent)}},
                                    config=_kernel_config())
            client.execute()
            for c, nc in zip(self.nb.cells, nb.cells[1:]):
                if c.cell_type == 'code': c['outputs'] = [dict2obj(dict(o)) for o in nc.get('outputs', [])]
    return exec_nbclient

def process_nb(path, execute=True, timeout=900):
    from execnb.nbio import read_nb
    from nbdev.process import NBProcessor
    from nbdev import processors as P
    procs = [P.populate_language, P.add_show_docs, P.strip_ansi, P.hide_line, P.filter_stream_, P.rm_header_dash,
             P.clean_show_doc, _exec_proc(path, execute, timeout), P.strip_ansi, P.rm_export, P.clean_magics, P.hide_,
             P.strip_hidden_metadata]
    nb = read_nb(path)
    nb.path_ = str(path)
    NBProcessor(nb=nb, procs=procs, process=True)
    return nb

# ---------------------------------------------------------------- source lines for show_doc's [source] links
_modidx = None
def source_link(name):
    "GitHub URL of the line where `name` (e.g. `DaliGraph.uniform`) is defined, or None"
    global _modidx
    if _modidx is None:
        _modidx = {}
        try: d = importlib.import_module('fastai_dali._modidx').d['syms']
        except Exception: d = {}
        for mod, syms in d.items():
            for full, (_, fn) in syms.items(): _modidx[full[len(mod)+1:]] = (mod, fn)
    if name not in _modidx: return None
    mod, fn = _modidx[name]
    url = f"{settings()['git_url']}/blob/{settings().get('branch', 'main')}/{fn}"
    try:
        with warnings.catch_warnings():  # fastai's layers use torch.jit.script, deprecated by torch (2.14 here): not ours to fix
            warnings.filterwarnings('ignore', r'`torch\.jit\.script` is deprecated', FutureWarning)
            obj = importlib.import_module(mod)
        for a in name.split('.'): obj = getattr(obj, a)
        obj = inspect.unwrap(getattr(obj, 'fget', obj))
        return f'{url}#L{inspect.getsourcelines(obj)[1]}'
    except Exception: return url

# ---------------------------------------------------------------- notebook -> Markdown
_re_opt = re.compile(r'^\s*#\|\s*([\w-]+)\s*:\s*(.*?)\s*$')
_re_warnline = re.compile(r'^\S.*(Warning|warnings\.warn)\b|^\s+warnings\.warn\(')

def _txt(x): return ''.join(x) if isinstance(x, list) else (x or '')

def _opts(src):
    "quarto-style `#| key: value` options left by nbdev, and the code without them"
    opts, code = {}, []
    for l in src.splitlines():
        m = _re_opt.match(l)
        if m and not code: opts[m.group(1)] = m.group(2).strip('"\'').lower()
        elif not l.strip().startswith('#|'): code.append(l)
    return opts, '\n'.join(code).strip('\n')

def _fence(s, lang=''):
    ticks = '```'
    while ticks in s: ticks += '`'
    if lang == 'text': lang = ' { .text .nb-out }'  # an output: styled apart from the code (docs_site/extra.css)
    return f'{ticks}{lang}\n{s.rstrip()}\n{ticks}'

_re_sd_src = re.compile(r'\[source\]\(([^)]*)\)(\{[^}]*\})?')
_re_sd_head = re.compile(r'^(#{2,4})\s+(\S+)\s*$', re.MULTILINE)

_re_sd_sig = re.compile(r'^```python\n.*?^```', re.MULTILINE | re.DOTALL)
_re_none_anno = re.compile(r'(?<=\w):NoneType=None\b')

def _show_doc_md(md, entries, page):
    """nbdev's show_doc Markdown: one id per entry (the name, lowercased, as nbdev's doc links), a source link to the
    line; in the signature a parameter `x=None` stays `x=None` (fastcore's `DocmentText` gives a parameter without an
    annotation the type of its default: `x:NoneType=None`, which says `x` takes None only; `bs:int=64` stays)"""
    md = _re_sd_sig.sub(lambda m: _re_none_anno.sub('=None', m.group(0)), md, count=1)
    m = _re_sd_head.search(md)
    if not m: return md
    name = m.group(2).replace('\\', '')
    anchor = name.lower()
    entries.setdefault(name, (page, anchor))
    md = md[:m.start()] + f'{m.group(1)} {name} {{ #{anchor} .doc-entry }}' + md[m.end():]
    link = source_link(name)
    md = _re_sd_src.sub((f'[source]({link}){{ .doc-source target="_blank" rel="noopener" }}' if link else ''), md, count=1)
    return md

def _output_md(o, img_dir, img_rel, stem, n, entries, page):
    ot = o.get('output_type')
    if ot == 'stream':
        t = _txt(o.get('text'))
        if o.get('name') == 'stderr':  # Python warnings (and the source line printed under each) are left out
            keep, prev_warn = [], False
            for l in t.splitlines():
                w = bool(_re_warnline.search(l)) or (prev_warn and l[:1].isspace())
                if not w: keep.append(l)
                prev_warn = w
            t = '\n'.join(keep)
        return _fence(t, 'text') if t.strip() else ''
    if ot == 'error':
        tb = re.sub(r'\x1B\[[0-?]*[ -/]*[@-~]', '', '\n'.join(o.get('traceback', [])))
        return _fence(tb, 'text')
    data = o.get('data', {})
    if 'image/png' in data:
        img_dir.mkdir(parents=True, exist_ok=True)
        fn = f'{stem}_{n}.png'
        (img_dir/fn).write_bytes(base64.b64decode(_txt(data['image/png'])))
        alt = _txt(data.get('text/plain', 'output')).replace('[', '').replace(']', '').replace('\n', ' ')[:80]
        return f'![{alt}]({img_rel}/{fn})'
    md = _txt(data.get('text/markdown', ''))
    # show_doc gives Markdown only; other objects with both (fastprogress's tables) are shown by their HTML
    if 'text/markdown' in data and ('text/html' not in data or '[source](' in md): return _show_doc_md(md, entries, page)
    if 'text/html' in data:
        # raw HTML for Python-Markdown: no blank line and no indentation, else parts of it become code blocks
        lines = [l if '<pre' in _txt(data['text/html']) else l.strip() for l in _txt(data['text/html']).splitlines()]
        h = '\n'.join(l for l in lines if l.strip())
        if not h: return ''
        return f'<div class="nb-output nb-html">\n{h}\n</div>'
    if 'text/plain' in data: return _fence(_txt(data['text/plain']), 'text')
    return ''

def nb_to_md(nb, page, img_dir, img_rel, entries):
    stem = Path(page).stem
    parts, n = [], 0
    for c in nb.cells:
        src = c.get('source') or ''
        if c.cell_type == 'markdown': parts.append(src); continue
        if c.cell_type != 'code': continue
        opts, code = _opts(src)
        if opts.get('include') == 'false': continue
        if code and opts.get('echo') != 'false': parts.append(_fence(code, 'python'))
        if opts.get('output') == 'false': continue
        for o in c.get('outputs', []):
            n += 1
            s = _output_md(o, img_dir, img_rel, stem, n, entries, page)
            if s: parts.append(s)
    return '\n\n'.join(p.strip('\n') for p in parts if p.strip()) + '\n'

# ---------------------------------------------------------------- links
_re_fenced = re.compile(r'(^```.*?^```[ \t]*$|^~~~.*?^~~~[ \t]*$)', re.MULTILINE | re.DOTALL)
_re_bt = re.compile(r'(?<![\[`\w])`([A-Za-z_][\w.]*|[\w.-]+/[\w./-]*)`(?![`\]])')
_re_mdlink = re.compile(r'(!?\[[^\]]*\]\()([^)\s]+)((?:\s+"[^"]*")?\))')

def _relpath(target, page):
    return os.path.relpath(target, os.path.dirname(page) or '.').replace(os.sep, '/')

def linkify(md, page, entries, src_nb, pages, copies):
    """Backticked names with an API entry become links to it (not in headings, code blocks or existing links);
    relative links to notebooks go to their page, to files under docs/ to the copy in the site, to other repo files
    to GitHub"""
    s = settings()
    def fix_link(m):
        url = m.group(2)
        if re.match(r'^[a-z]+:|^#|^/', url): return m.group(0)
        path, _, frag = url.partition('#')
        tgt = (src_nb.parent/path).resolve()
        try: rel = tgt.relative_to(ROOT)
        except ValueError: return m.group(0)
        if tgt in pages: new = _relpath(pages[tgt], page)  # a notebook, or docs/results/README.md: its page
        elif rel.parts and rel.parts[0] == 'docs' and tgt.exists():
            copies.add(rel); new = _relpath(str(rel), page)
        elif tgt.exists(): new = f"{s['git_url']}/blob/{s.get('branch','main')}/{rel.as_posix()}"
        else: return m.group(0)
        return m.group(1) + new + (f'#{frag}' if frag else '') + m.group(3)
    def bt(m):
        nm = m.group(1)
        if '/' in nm:  # a path in the repository: its page in the site, else GitHub
            tgt = (ROOT/nm.rstrip('/')).resolve()
            if not nm[0].isalnum() or not tgt.exists() or ROOT not in tgt.parents: return m.group(0)
            if tgt in pages: href = _relpath(pages[tgt], page)
            else: href = f"{s['git_url']}/{'tree' if tgt.is_dir() else 'blob'}/{s.get('branch','main')}/{tgt.relative_to(ROOT).as_posix()}"
            return f'[`{nm}`]({href})'
        if nm not in entries: return m.group(0)
        p, a = entries[nm]
        href = (f'#{a}' if p == page else f'{_relpath(p, page)}#{a}')
        return f'[`{nm}`]({href})'
    out = []
    for i, chunk in enumerate(_re_fenced.split(md)):
        if i % 2: out.append(chunk); continue
        lines = []
        for l in chunk.split('\n'):
            if l.lstrip().startswith('#') or l.startswith('    ') or '<' in l and '>' in l and l.lstrip().startswith('<'):
                lines.append(l); continue
            l = _re_mdlink.sub(fix_link, l)
            # backticked names, outside existing links
            segs = re.split(r'(\[[^\]]*\]\([^)]*\))', l)
            lines.append(''.join(sg if j % 2 else _re_bt.sub(bt, sg) for j, sg in enumerate(segs)))
        out.append('\n'.join(lines))
    return ''.join(out)

# ---------------------------------------------------------------- mkdocs
def mkdocs_yml(src_dir, out_dir, nav):
    s = settings()
    def nav_yaml():
        lines = []
        for title, item in nav:
            if isinstance(item, str): lines.append(f'  - {json.dumps(title)}: {item}')
            else:
                lines.append(f'  - {json.dumps(title)}:')
                lines += [f'    - {json.dumps(t)}: {p}' for t, p in item]
        return '\n'.join(lines)
    return f"""# generated by scripts/build_docs.py
site_name: {s['lib_name']}
site_description: {json.dumps(s['description'])}
docs_dir: {json.dumps(str(src_dir))}
site_dir: {json.dumps(str(out_dir))}
use_directory_urls: true
strict: false
not_in_nav: /docs/  # files under docs/ that pages link to, copied as they are (else mkdocs lists them at every build)
theme:
  name: material
  font: false
  features: [navigation.sections, navigation.top, navigation.tracking, toc.follow, search.highlight, search.suggest, content.code.copy]
  palette:
    - scheme: default
      primary: indigo
extra_css: [assets/extra.css]
extra:
  generator: false
plugins:
  - search
markdown_extensions:
  - tables
  - attr_list
  - md_in_html
  - admonition
  - pymdownx.superfences
  - pymdownx.highlight:
      use_pygments: true
      line_spans: __span
  - toc:
      permalink: true
validation:
  links:
    not_found: warn
    anchors: warn
    absolute_links: warn
nav:
{nav_yaml()}
"""

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('out', nargs='?', default=str(ROOT/'_site'), help='where the HTML site goes (default _site)')
    ap.add_argument('--src', default=str(ROOT/'_site_src'), help='where the Markdown sources go (default _site_src)')
    ap.add_argument('--no-exec', action='store_true', help="don't run the notebooks; use their saved outputs")
    ap.add_argument('--only', nargs='*', help='build these notebooks only (substrings of the file names), with index')
    ap.add_argument('--timeout', type=int, default=900, help='seconds a cell may run')
    a = ap.parse_args(argv)
    out, base = Path(a.out).resolve(), Path(a.src).resolve()
    t0 = time.time()
    if base.exists(): shutil.rmtree(base)
    src = base/'docs'
    (src/'assets').mkdir(parents=True)
    shutil.copy(SITE_CFG/'extra.css', src/'assets'/'extra.css')
    nbs = notebooks(a.only)
    pages = {}
    for p in nbs:  # nbdev's names; the whole file name where two notebooks would share one (`04_data`, `10_data`)
        pages[p] = page_name(p) if page_name(p) not in pages.values() else p.stem + '.md'
    entries, processed = {}, {}
    timings = []
    for p in nbs:
        t = time.time()
        try: nb = process_nb(p, execute=not a.no_exec, timeout=a.timeout)
        except Exception as e:  # nbclient's errors do not say which notebook (a kernel that died prints its traceback above)
            raise SystemExit(f'[docs] {p.relative_to(ROOT).as_posix()} failed: {type(e).__name__}: {e}') from e
        page = pages[p]
        processed[p] = nb_to_md(nb, page, src/'images', 'images', entries)
        timings.append((p.relative_to(ROOT).as_posix(), time.time() - t))
        print(f'[docs] {timings[-1][0]}: {timings[-1][1]:.1f}s', flush=True)
    t_exec = time.time() - t0
    results = ROOT/'docs'/'results'/'README.md'  # the measured results: a Guides page
    if results.exists():
        pages[results] = 'results.md'
        processed[results] = results.read_text()
    copies = set()
    for p, md in processed.items():
        (src/pages[p]).write_text(linkify(md, pages[p], entries, p, pages, copies))
    for rel in copies:
        dst = src/rel
        if (ROOT/rel).is_dir(): shutil.copytree(ROOT/rel, dst, dirs_exist_ok=True)
        else: dst.parent.mkdir(parents=True, exist_ok=True); shutil.copy(ROOT/rel, dst)
    nav = [('Home', 'index.md')]
    for sec in SECTIONS:
        items = [(title_of(p), pages[p]) for p in nbs[1:] if section(p.stem) == sec]
        if sec == 'Guides' and results.exists(): items.append((title_of_md(results), 'results.md'))
        if items: nav.append((sec, items))
    cfg = base/'mkdocs.yml'
    cfg.write_text(mkdocs_yml(src, out, nav))
    t = time.time()
    r = subprocess.run([sys.executable, '-m', 'mkdocs', 'build', '--clean', '-f', str(cfg)], cwd=ROOT)
    if r.returncode: sys.exit(f'[docs] mkdocs build failed ({r.returncode})')
    t_mk = time.time() - t
    print(f'[docs] notebooks: {len(nbs)} in {t_exec:.1f}s; API entries: {len(entries)}; mkdocs: {t_mk:.1f}s; '
          f'site: {out}', flush=True)
    return out

if __name__ == '__main__': main()

"""The module map in CONTRIBUTING.md is the package's layering: it lists every module, and each module imports only the
modules above it in the table (at the top or inside a function: a lazy import is still a dependency), so there is no
circle. A package's `__init__` may import its own modules (`bench` re-exports `bench.core`, ...). Reads the source only."""
import ast, re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT/'fastai_dali'

def module_map():
    "The modules of CONTRIBUTING.md's map, top to bottom"
    return re.findall(r'^\| `\w+` \| `([\w.]+)` \|', (ROOT/'CONTRIBUTING.md').read_text(), re.M)

def module_file(m):
    p = PKG.joinpath(*m.split('.'))
    return p/'__init__.py' if p.is_dir() else p.with_suffix('.py')

def package_modules():
    "Every module of the package, as the map names them (`items`, `bench.core`, `bench`)"
    res = []
    for f in PKG.rglob('*.py'):
        if f.name == '_modidx.py' or f == PKG/'__init__.py' or '__pycache__' in f.parts: continue
        parts = f.relative_to(PKG).with_suffix('').parts
        res.append('.'.join(parts[:-1] if parts[-1] == '__init__' else parts))
    return sorted(res)

def imported(m, known):
    "The modules of `known` that module `m` imports, anywhere in its code"
    f = module_file(m)
    pkg = m.split('.') if f.name == '__init__.py' else m.split('.')[:-1]
    res = set()
    def add(parts):   # the longest known module that `parts` (a dotted path inside the package) names
        for k in range(len(parts), 0, -1):
            if '.'.join(parts[:k]) in known: res.add('.'.join(parts[:k])); return
    for n in ast.walk(ast.parse(f.read_text())):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split('.')[0] == 'fastai_dali': add(a.name.split('.')[1:])
        elif isinstance(n, ast.ImportFrom):
            if n.level: base = pkg[:len(pkg) - (n.level - 1)]
            elif (n.module or '').split('.')[0] == 'fastai_dali': base = []
            else: continue
            mod = (n.module or '').split('.')
            if not n.level: mod = mod[1:]
            parts = base + [p for p in mod if p]
            if '.'.join(parts) in known and not n.module is None: add(parts)
            else:
                for a in n.names: add(parts + [a.name])   # (`from fastai_dali import core`, `from . import core`)
                add(parts)
    return res - {m}

def test_map_lists_every_module():
    listed = module_map()
    assert len(listed) == len(set(listed)), 'a module listed twice'
    assert sorted(set(listed)) == package_modules(), (f'missing from the map: {sorted(set(package_modules()) - set(listed))}; '
                                                      f'listed but absent: {sorted(set(listed) - set(package_modules()))}')

def test_each_module_imports_only_modules_above_it():
    order = module_map()
    known = set(order)
    bad = [(m, d) for i,m in enumerate(order) for d in sorted(imported(m, known))
           if order.index(d) > i and not d.startswith(m + '.')]   # (a package may import its own modules)
    assert not bad, f'imports of a module below (module, what it imports): {bad}'

def test_the_check_sees_lazy_and_relative_imports():
    known = set(module_map())
    assert 'errors' in imported('sources', known)     # inside a function
    assert 'sources' in imported('items', known)      # `from .sources import ...`
    assert 'bench.core' in imported('bench.loaders', known) and 'data' in imported('bench.loaders', known)

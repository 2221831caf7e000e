"""Parameters are documented the fastai way: a function's or class's docstring is one short sentence (at most 200
characters), the parameters' meaning in comments beside them or in the notebooks' prose, measurements in the notebooks
and `docs/results/`. Reads the source only; a control checks that the reader finds a long docstring."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1]/'fastai_dali'
LIMIT = 200

def long_docstrings(source, name='<source>'):
    "(file, qualified name, length) of every function or class docstring in `source` over `LIMIT` characters"
    res = []
    def visit(node, prefix=''):
        for n in ast.iter_child_nodes(node):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                d = ast.get_docstring(n)
                if d and len(d) > LIMIT: res.append((name, prefix + n.name, len(d)))
                visit(n, f'{prefix}{n.name}.')
            else: visit(n, prefix)
    visit(ast.parse(source))
    return res

def test_no_long_docstring():
    found = [r for f in sorted(PKG.rglob('*.py')) if f.name != '_modidx.py' for r in long_docstrings(f.read_text(), str(f.relative_to(PKG)))]
    assert found == [], found

def test_control_finds_a_long_docstring():
    src = f'def f():\n    "{"x" * (LIMIT + 1)}"\nclass C:\n    def g(self):\n        "{"y" * LIMIT}"\n    def h(self):\n        "{"z" * (LIMIT + 5)}"\n'
    assert long_docstrings(src) == [('<source>', 'f', LIMIT + 1), ('<source>', 'C.h', LIMIT + 5)]

"""`scripts/` holds what a reader needs to reproduce the published results: each script says how to run it (its module
docstring names `scripts/NAME` with its arguments) and takes its folders as arguments, with no absolute path written into
its code (a default comes from the temporary folder or the arguments). Reads the source only; a control checks the
reader."""
import ast
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1]/'scripts'

def fixed_paths(source):
    "The string constants of `source`'s code (not its docstrings) that are absolute paths of a machine"
    tree, docs = ast.parse(source), set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body and isinstance(n.body[0], ast.Expr) \
           and isinstance(n.body[0].value, ast.Constant): docs.add(id(n.body[0].value))
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
            and n.value.startswith(('/tmp', '/root', '/home', '/work', '/data', '/mnt'))]

def test_every_script_says_how_to_run_it():
    missing = [f.name for f in sorted(SCRIPTS.glob('*.py')) if f'scripts/{f.name}' not in (ast.get_docstring(ast.parse(f.read_text())) or '')]
    assert missing == [], missing

def test_no_fixed_paths():
    found = {f.name: p for f in sorted(SCRIPTS.glob('*.py')) if (p := fixed_paths(f.read_text()))}
    assert found == {}, found

def test_control_finds_a_fixed_path():
    src = '"""Run: python scripts/x.py /tmp/out"""\nroot = "/tmp/data"\ndef f():\n    "/tmp in a docstring"\n    return Path("/home/me") / "rel"\n'
    assert fixed_paths(src) == ['/tmp/data', '/home/me']

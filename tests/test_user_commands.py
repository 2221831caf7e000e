"""What a user runs first: the console commands `fastai-dali-demo` and `fastai-dali bench`, run as the installed
scripts (exit status 0, results on stdout, nothing on stderr), the bench's loader timing next to `ImageDataLoaders`'
worker processes, and `from fastai_dali.all import *` after `from fastai.vision.all import *`.

Console scripts pass what their entry point returns to `sys.exit`: anything but None is exit status 1, printed to
stderr. fastai's import warns that `torch.jit.script` is deprecated (torch >= 2.10): not ours, so filtered out; so are
DALI's notices, on a machine with a GPU, that nvImageCodec's optional JPEG 2000 and TIFF libraries are not installed.
"""
import ast, json, os, re, shutil, subprocess, sys, textwrap
from configparser import ConfigParser
from importlib import metadata
from pathlib import Path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
import pytest
from conftest import DEVICE

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, 'PYTHONWARNINGS': 'ignore::FutureWarning:torch.jit._script', 'MPLBACKEND': 'Agg'}
CHILD = 'can only test a child process'
_CODEC_NOTICE = re.compile(r'nvjpeg2k|nvjpeg2000|nvtiff', re.I)  # "Failed to load nvjpeg2k library! ...", etc.

def not_dalis_codec_notices(stderr):
    "`stderr` without DALI's notices that the optional JPEG 2000 / TIFF libraries are missing (an environment's, not ours)"
    return ''.join(l for l in stderr.splitlines(keepends=True) if not _CODEC_NOTICE.search(l))

def _entry_point(name):
    "settings.ini's `module:function` for console script `name`"
    cfg = ConfigParser(delimiters=['=']); cfg.read(ROOT/'settings.ini', encoding='utf-8')
    return dict(o.split('=') for o in cfg['DEFAULT']['console_scripts'].split())[name]

def run_script(name, *args, cwd, timeout=300):
    "Run console script `name` with `args`: the installed one, or (package not installed, e.g. imported from the source tree) its entry point as the script calls it"
    exe = BIN/name
    try: metadata.version('fastai_dali'); installed = True
    except metadata.PackageNotFoundError: installed = False
    if installed or exe.exists():
        assert exe.exists(), f"{exe} is missing: install the package (pip install -e .) to get its console scripts"
        cmd = [str(exe)]
    else:  # what setuptools' generated script does
        mod,func = _entry_point(name).split(':')
        cmd = [sys.executable, '-c', f'import sys; from {mod} import {func}; sys.exit({func}())']
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=ENV)

def _installed_with(keys=('requirements', 'dali_cuda120')):
    "Distributions `pip install -e '.[cuda120]'` brings: settings.ini's `keys` and what they require, as installed here"
    cfg = ConfigParser(delimiters=['=']); cfg.read(ROOT/'settings.ini', encoding='utf-8')
    todo,seen = [Requirement(r).name for k in keys for r in cfg['DEFAULT'][k].split()],set()
    while todo:
        n = canonicalize_name(todo.pop())
        if n in seen: continue
        seen.add(n)
        try: reqs = metadata.requires(n) or []
        except metadata.PackageNotFoundError: continue
        todo += [r.name for r in map(Requirement, reqs) if not r.marker or r.marker.evaluate({'extra': ''})]
    return seen

def test_plain_install_brings_every_import():
    # the console commands import scikit-image (sample photos) at run time: it was in the dev extra only
    mods = set()
    for f in (ROOT/'fastai_dali').glob('*.py'):
        for n in ast.walk(ast.parse(f.read_text(encoding='utf-8'))):
            if isinstance(n, ast.Import): mods |= {a.name.split('.')[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module: mods.add(n.module.split('.')[0])
    mods -= set(sys.stdlib_module_names) | {'fastai_dali'}
    dists,have = metadata.packages_distributions(),_installed_with()
    missing = {m: dists.get(m) for m in sorted(mods) if not have & {canonicalize_name(d) for d in dists.get(m, [])}}
    assert 'skimage' in mods and missing == {}, f"imported by fastai_dali, not brought by its requirements: {missing}"

def test_demo_command(tmp_path):
    r = run_script('fastai-dali-demo', '--device', 'cpu', '--n-train', '8', '--n-valid', '4', '--size', '32', '--bs', '8',
                   cwd=tmp_path)
    assert (r.returncode, not_dalis_codec_notices(r.stderr)) == (0, ''), r.stderr[-3000:]
    lines = r.stdout.splitlines()[-5:]
    assert lines[0] == 'device: cpu  DALI backend: CPU', lines
    assert lines[1].startswith('accuracy after 1 epoch(s): '), lines
    # 4 classes x 8 images, bs 8: 4 batches, the first 2 warm up
    assert lines[2].startswith('training, model + data: ') and ' img/s (16 images, ' in lines[2], lines
    assert lines[3].startswith('loader alone: ') and lines[4].startswith('whole fit: '), lines

def test_bench_command(tmp_path):
    out = tmp_path/'out'
    r = run_script('fastai-dali', 'bench', '--n', '50', '--device', 'cpu', '--bs', '4', '--size', '32', '--workers', '2',
                   '--repeats', '1', '--max-batches', '2', '--archs', '', '--no-aug', '--no-mixed', '--out', str(out),
                   cwd=tmp_path)
    assert (r.returncode, not_dalis_codec_notices(r.stderr)) == (0, ''), r.stderr[-3000:]
    assert '| ImageDataLoaders train (2 workers) |' in r.stdout and f'wrote {out}/bench.json' in r.stdout, r.stdout[-2000:]
    assert sorted(p.name for p in out.glob('bench.*')) == ['bench.json', 'bench.md', 'bench.png']

def test_bench_sections_are_checked(capsys):
    import pytest
    from fastai_dali.bench import cli, SECTIONS
    with pytest.raises(SystemExit) as e: cli(['bench', '--sections', 'throughput,speed'])
    assert e.value.code == 2 and 'unknown sections speed' in capsys.readouterr().err
    assert {'throughput', 'augment', 'mixed', 'training', 'memory', 'resize', 'parity'} <= set(SECTIONS)

def test_samples_import_light():
    # the sample folders (tests, tutorials, the bench's data, the demo's) come without the bench, DALI or fastai: a bench's
    # parent process or a test writes its data before anything heavy is imported
    code = ('import sys, fastai_dali.samples; '
            'print(sorted(m for m in ("fastai_dali.bench", "nvidia.dali", "fastai") if m in sys.modules))')
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300, env=ENV)
    assert (r.returncode, r.stdout.split()) == (0, ['[]']), r.stderr[-3000:]

# An `ImageDataLoaders` pass that `time_loader` cuts short keeps its worker processes until its iterator is freed. On the
# H200 (Python 3.12) fastai's pass outlived the timing, held by a reference cycle of frames, so the next loader's forked
# workers inherited it, and a worker whose garbage collector freed it printed torch's `AssertionError: can only test a
# child process`. Python 3.11 frees the pass at once, so here loader `a`'s passes are held by a cycle explicitly, and
# loader `b`'s workers collect garbage on every item (what their periodic collections do, sooner or later).
_TIMING = '''
import gc, json, os, sys, tempfile
from pathlib import Path
from fastai.vision.all import ImageDataLoaders, Resize, Transform, PILImage
from fastai_dali.samples import make_image_folder
from fastai_dali.bench import bench_loaders
# what the imports made lives as long as the process: out of the collector's sight, the workers' collection on every item
# takes milliseconds instead of 0.4-1 s (what they must find, loader `a`'s abandoned passes, is made later)
gc.collect(); gc.freeze()

class HeldByCycle:
    "Passes of `dl`, each generator in a reference cycle: only the garbage collector frees an abandoned one"
    def __init__(self, dl): self.dl = dl
    def __iter__(self):
        box = []
        g = self._pass(box); box.append(g)
        return g
    def _pass(self, box): yield from self.dl

class CollectInWorker(Transform):
    "Collect garbage in the process that loads the item (a worker), and note that process"
    def encodes(self, x:PILImage):
        gc.collect()
        with open(sys.argv[1], 'a') as f: f.write(f'{os.getpid()}\\n')
        return x

path = make_image_folder(Path(tempfile.mkdtemp())/'imgs', n_train=16, n_valid=4, min_size=32, max_size=64)
a = ImageDataLoaders.from_folder(path, item_tfms=Resize(32), bs=4, device='cpu', num_workers=2)
b = ImageDataLoaders.from_folder(path, item_tfms=[Resize(32), CollectInWorker()], bs=4, device='cpu', num_workers=2)
open(sys.argv[1], 'w').close()
gc.collect(); gc.disable()  # this process collects only when told to
r = bench_loaders({'a': lambda: HeldByCycle(a.train), 'b': lambda: b.train}, max_batches=2, warmup=1, repeats=2,
                  show_progress=False)
print(json.dumps({'timed': sorted(r), 'pid': os.getpid()}))
'''

@pytest.mark.skipif(DEVICE != 'cpu', reason="fastai's workers on the CPU, the cycle made explicitly (any Python): CI runs this")
def test_bench_timing_leaves_no_worker_tracebacks(tmp_path):
    script,pids = tmp_path/'timing.py',tmp_path/'pids.txt'
    script.write_text(textwrap.dedent(_TIMING))
    r = subprocess.run([sys.executable, str(script), str(pids)], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert CHILD not in r.stderr and 'Exception ignored' not in r.stderr, r.stderr[-3000:]
    res = json.loads(r.stdout.splitlines()[-1])
    assert res['timed'] == ['a', 'b'], res
    workers = set(pids.read_text().split()) - {str(res['pid'])}
    assert len(workers) >= 2, workers  # loader b's items were loaded, and garbage collected, in its worker processes

def test_all_keeps_fastai_names():
    import fastai.vision.all as fva, fastai.vision.augment as fa_aug, fastai_dali.all as fda
    fastai_names = set(getattr(fva, '__all__', None) or (n for n in vars(fva) if not n.startswith('_')))
    # a name in both must be the same object (a compatibility name exported only where fastai has none is fine)
    assert [n for n in fda.__all__ if n in fastai_names and getattr(fda, n) is not getattr(fva, n)] == []
    ns = {}
    exec('from fastai.vision.all import *\nfrom fastai_dali.all import *', ns)
    assert ns['affine_mat'] is fa_aug.affine_mat

def test_passing_run_ends_on_its_summary(tmp_path):
    # the README's `pytest -q tests`: the measured pixel differences go to a log file, not after the summary line
    log = tmp_path/'pixel_differences.txt'
    r = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-W', 'ignore',
                        f'{ROOT}/tests/test_parity.py::test_pixel_parity[crop-32-raw]'], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env={**ENV, 'FASTAI_DALI_PARITY_LOG': str(log)})
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and re.fullmatch(r'1 passed in [\d.]+s', lines[-1]), r.stdout[-2000:]
    assert 'pixel differences' not in r.stdout and len(lines) <= 3, r.stdout[-2000:]
    assert log.read_text().splitlines()[2].startswith('crop           32     raw'), log.read_text()

def test_ci_runs_the_tests_on_a_users_install():
    # the dev extra pins fastcore<2 (nbdev 2.4.14), holding fastai at an older release than a plain install resolves:
    # CI runs the tests a second time in an environment with the package and the `test` extra only
    cfg = ConfigParser(delimiters=['=']); cfg.read(ROOT/'settings.ini', encoding='utf-8')
    test_reqs = [Requirement(r) for r in cfg['DEFAULT']['test_requirements'].split()]
    assert not {'nbdev', 'fastcore', 'fastai', 'execnb'} & {r.name for r in test_reqs}, test_reqs
    ci = (ROOT/'.ci'/'run').read_text()
    user = ci[ci.index('pip install -q -e ".[cuda120,test]"'):]
    assert 'pytest -q tests' in user and 'dev' not in user.split('\n')[0], user[:300]

def test_ci_stops_early_naming_a_full_disk(tmp_path):
    "Too little disk: .ci/run stops before installing anything, saying where and how much, not pip's bare ENOSPC later"
    (tmp_path/'.ci').mkdir(); shutil.copy(ROOT/'.ci'/'run', tmp_path/'.ci'/'run')
    r = subprocess.run(['bash', str(tmp_path/'.ci'/'run')], capture_output=True, text=True, timeout=60,
                       env={**os.environ, 'CI_NEED_GB': '1000000'})
    assert r.returncode == 1 and 'GB free on /' in r.stderr and 'CI needs about 1000000 GB' in r.stderr, r.stderr
    assert not (tmp_path/'.venv').exists() and '::: disk:' in r.stdout, r.stdout

def test_shards_command_as_installed(tmp_path):
    "`fastai-dali-shards`, the shard writer's own console command (settings.ini's console_scripts), as a user runs it"
    from fastai_dali.samples import make_image_folder
    src = make_image_folder(tmp_path/'photos', n_train=3, n_valid=2, classes=('coffee', 'rocket'))
    r = run_script('fastai-dali-shards', str(src), str(tmp_path/'out'), '--per-shard', '4', cwd=tmp_path)
    assert r.returncode == 0 and 'train: 2 shard(s), valid: 1 shard(s)' in r.stdout, r.stderr[-2000:]
    r = run_script('fastai-dali-shards', str(tmp_path/'nope'), str(tmp_path/'o'), cwd=tmp_path)
    assert r.returncode == 2 and 'does not exist' in r.stderr and 'Traceback' not in r.stderr

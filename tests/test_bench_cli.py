"""`fastai-dali bench` as a newcomer meets it, on a small machine without a GPU: worker counts that fit the cores,
goals compared with `ImageDataLoaders`' fastest row and shown as a table, progress bars that say what they time, and
no log line that reads like a failure (torch.profiler's tracer, kineto, prints from C++ on file descriptor 2, so the
trace runs in a subprocess and its output is read from there).
"""
import io, json, os, re, subprocess, sys, textwrap, types
from pathlib import Path
import pytest
from conftest import DEVICE
from fastai_dali.bench import (fit_workers, fastest_workers, throughput_targets, goals_markdown, show_markdown,
                               bench_loaders, fit_rounds, cli)
from fastai_dali.bench.core import ROW_RAW

from test_user_commands import not_dalis_codec_notices  # DALI's notices that optional codec libraries are missing
# (without the runner's console size: pytest-xdist's processes set COLUMNS=80, and the bars' labels are clipped to fit)
ENV = {**{k: v for k,v in os.environ.items() if k not in ('COLUMNS', 'LINES')},
       'PYTHONWARNINGS': 'ignore::FutureWarning:torch.jit._script', 'MPLBACKEND': 'Agg'}
# what reads like a failure: kineto's lines ("USDT: ... profiler_start", "ERROR: ... gpuGetDeviceCount failed"), the
# old "MISS" lines of the goals, any error or warning
_ALARMING = re.compile(r'ERROR|gpuGetDeviceCount|USDT|WARNING|Warning|Traceback|^MISS ', re.M)

def _python(code, tmp_path, timeout=300):
    return subprocess.run([sys.executable, '-c', textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, env=ENV)

def test_trace_prints_no_kineto_lines(tmp_path):
    "The bench's trace (`fit_trace`, torch.profiler) on the CPU: a summary, and nothing from kineto on stdout or stderr"
    r = _python('''
        import json
        from torch import nn
        from fastai.data.core import DataLoaders
        from fastai_dali.bench import SyntheticDL, fit_trace
        tiny = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
        sdl = SyntheticDL(bs=4, size=16, n_batches=4, c=2, device='cpu')
        s = fit_trace(DataLoaders(sdl, sdl), None, 2, start=3, n=5, bf16=False, channels_last=False, model=tiny)
        print(json.dumps({'batches': s['batches']}))
        ''', tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1]) == {'batches': 5}, r.stdout[-2000:]
    out = r.stdout + r.stderr
    assert not re.search(r'ERROR|gpuGetDeviceCount|USDT', out), out[-3000:]

def test_default_workers_fit_the_machine():
    assert [fit_workers(c) for c in (1, 2, 4, 16, 64)] == [(1,), (1, 2), (1, 2, 4), (4, 8, 16), (4, 8, 16)]
    from fastcore.basics import defaults
    mine = fit_workers()
    assert max(mine) == min(16, defaults.cpus) and max(mine) <= defaults.cpus  # fastai's default, never more than the cores

def test_help_says_the_fitted_defaults(capsys):
    with pytest.raises(SystemExit) as e: cli(['bench', '--help'])
    h = ' '.join(capsys.readouterr().out.split())  # argparse wraps the lines
    fw = ','.join(map(str, fit_workers()))
    assert e.value.code == 0 and f"min(16, cores), its half and its quarter: {fw} here" in h and f'as --workers, {fw} here' in h, h

def test_goals_compare_with_the_fastest_imagedataloaders():
    thr = {ROW_RAW: {'img_s': 100.}, 'DaliDataLoaders train': {'img_s': 95.}, 'ImageDataLoaders train (4 workers)': {'img_s': 50.},
           'ImageDataLoaders train (16 workers)': {'img_s': 20.}}  # 16 workers, on a machine that runs 4 faster
    assert fastest_workers(thr) == 4
    res = {'throughput': thr, 'fit_img_s': {'resnet18': {'model only (synthetic batches on the GPU)': 100., 'DaliDataLoaders': 90.,
                                                         'ImageDataLoaders (4 workers)': 30., 'ImageDataLoaders (16 workers)': 9.}}}
    t = {o['target']: o['value'] for o in throughput_targets(res, gpu=False)}
    assert t['DaliDataLoaders train / ImageDataLoaders (4 workers, its fastest of 2 counts)'] == 1.9, t
    assert t['learn.fit resnet18: DaliDataLoaders / ImageDataLoaders (4 workers)'] == 3.0, t
    assert not any('16 workers' in k for k in t), t

def test_goals_are_a_table():
    res = {'targets': [{'target': 'a / b', 'value': 1.234, 'goal': 0.9, 'met': True, 'why': ''},
                       {'target': 'c / d', 'value': 3.0, 'goal': 12, 'met': False, 'why': 'bounded by decode-only / c = 4.0'}],
           'settings': {'repeats': 3, 'max_batches': 60}}
    lines = goals_markdown(res).splitlines()
    assert [c.strip() for c in lines[0].strip('|').split('|')] == ['goal (a ratio of this run)', 'measured', 'target', 'result']
    assert re.fullmatch(r'\|-+\|-+:\|-+:\|-+\|', lines[1]), lines[1]
    assert [c.strip() for c in lines[2].strip('|').split('|')] == ['a / b', '1.23', '≥ 0.9', 'met']
    assert [c.strip() for c in lines[3].strip('|').split('|')] == ['c / d', '3.00', '≥ 12', 'below goal: bounded by decode-only / c = 4.0']
    assert len(lines) == 4 and len({len(l) for l in lines}) == 1  # padded: a table in a terminal too

def test_tables_render_in_a_notebook(monkeypatch):
    "Where stdout is a notebook's (ipykernel's), the tables go out as `text/markdown` (rendered by Jupyter and the docs builder)"
    class Markdown:  # IPython's, as far as the bench uses it (IPython is there wherever ipykernel is; not a requirement)
        def __init__(self, data): self.data = data
    class OutStream(io.StringIO): pass
    OutStream.__module__ = 'ipykernel.iostream'
    shown,out = [],OutStream()
    monkeypatch.setitem(sys.modules, 'IPython.display', types.SimpleNamespace(display=shown.append, Markdown=Markdown))
    monkeypatch.setattr(sys, 'stdout', out)
    show_markdown('| a |\n|---|')
    assert [type(o).__name__ for o in shown] == ['Markdown'] and shown[0].data == '| a |\n|---|' and out.getvalue() == ''

def test_bars_say_what_they_time(capsys, monkeypatch):
    monkeypatch.setenv('COLUMNS', '160')  # a console bar clips its comment to the terminal's width (80 on some machines)
    class Batches:
        def __iter__(self): return iter([(b'x'*4,)]*4)
    bench_loaders({'a loader': Batches, 'another': Batches}, warmup=1, repeats=2)
    fit_rounds({'row a': lambda: lambda: 1., 'row b': lambda: lambda: 2.}, epochs=2, label='timing learn.fit tiny')
    out = capsys.readouterr().out
    for s in ('timing loaders 1/2: a loader', 'timing loaders 2/2: another', 'timing loaders: done',
              'timing learn.fit tiny warm-up: row a', 'timing learn.fit tiny 1/1: row b', 'timing learn.fit tiny: done'):
        assert s in out, (s, out[-2000:])

def _two_cores():
    "A small machine: the run's first two cores (fastai's `defaults.cpus` counts the cores a process may run on; in pytest-xdist's processes, each kept to its share of the cores by conftest, the run's)"
    run = os.environ.get('FASTAI_DALI_RUN_CORES')
    os.sched_setaffinity(0, sorted(map(int, run.split(',')) if run else os.sched_getaffinity(0))[:2])

@pytest.mark.skipif(DEVICE != 'cpu', reason='a 2-core machine without a GPU: CI runs this (the GPU suite: test_bench_command)')
def test_bench_command_on_a_small_machine(tmp_path):
    """The command with its default worker counts, on the CPU of a 2-core machine (the CI machine is one; on a larger one
    the command runs on two of its cores): fitted counts, goals against the fastest as a table, labelled bars, nothing alarming"""
    out = tmp_path/'out'
    r = subprocess.run([sys.executable, '-c', 'import sys; from fastai_dali.bench import cli; sys.exit(cli())', 'bench', '--n', '60',
                        '--device', 'cpu', '--bs', '4', '--size', '32', '--repeats', '1', '--max-batches', '2', '--archs', '',
                        '--sections', 'throughput,augment', '--out', str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path, env=ENV, preexec_fn=_two_cores)
    assert r.returncode == 0, r.stderr[-3000:]
    said = not_dalis_codec_notices(r.stdout + r.stderr)  # (an environment's: the GPU machine has no nvTIFF/nvJPEG2000)
    assert not _ALARMING.search(said), said[-3000:]
    res = json.loads((out/'bench.json').read_text())
    W,fw = res['imagedataloaders_workers'],list(fit_workers(2))
    assert fw == [1, 2]
    nw = lambda w: f"{w} worker{'' if w == 1 else 's'}"
    assert res['settings']['workers'] == fw and res['settings']['py_workers'] == fw, res['settings']
    thr = res['throughput']
    assert W == fastest_workers(thr) and {f'ImageDataLoaders train ({nw(w)})' for w in fw} <= set(thr), (W, list(thr))
    assert f'ImageDataLoaders train + aug_transforms() ({nw(W)})' in thr, list(thr)
    idl = [o['target'] for o in res['targets'] if 'ImageDataLoaders' in o['target']]
    assert idl and all(f'ImageDataLoaders ({nw(W)}' in k for k in idl), idl
    assert '| goal (a ratio of this run) ' in r.stdout and 'timing loaders 1/1: ' in r.stdout, r.stdout[-3000:]
    assert 'timing 1/1: ImageDataLoaders' in r.stdout, r.stdout[-3000:]  # timed on its own, after the others
    # every bar keeps a length: its comment leaves it room in a 100-column console (fastprogress' size where there is no terminal)
    bars = re.findall(r'\|([█-]*)\| [\d.]+% \[', r.stdout)
    assert bars and min(map(len, bars)) >= 8, (bars, r.stdout[-3000:])
    assert '### Goals' in (out/'bench.md').read_text()
    # on the CPU the bench leaves the process's CUDA work queues as they were (on a GPU it asks for 32, as the README advises)
    assert res['machine']['work_queues'] == ENV.get('CUDA_DEVICE_MAX_CONNECTIONS'), res['machine']

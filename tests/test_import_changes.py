"""What `from fastai_dali.all import *` changes outside fastai_dali's own objects is what `fastai_dali.patches.PATCHES` and
the README list, and nothing more; importing every other module changes nothing: in a fresh process, every attribute of
every class and module of fastai and fastcore, fastai's `defaults`, the environment and the process's exit hooks (`atexit`,
multiprocessing's finalizers: a pipeline's are registered with the first pipeline), read before the import and after."""
import json, os, subprocess, sys, textwrap
from pathlib import Path
from fastcore.test import test_eq as eq   # (as `eq`: pytest would collect `test_eq`)

SNAPSHOT = textwrap.dedent('''
    import os, sys, json
    def snapshot():
        res = {}
        for name,m in list(sys.modules.items()):
            if not name.split('.')[0] in ('fastai', 'fastcore') or m is None: continue
            for k,v in list(vars(m).items()):
                res[f'{name}.{k}'] = id(v)
                if isinstance(v, type) and v.__module__ == name:   # (a class, where it is defined)
                    for a,o in list(vars(v).items()): res[f'{name}.{k}.{a}'] = id(o)
        from fastai.torch_core import defaults
        res['defaults'] = repr(sorted((k, repr(v)) for k,v in vars(defaults).items()))
        res['environ'] = repr(sorted(os.environ.items()))
        import atexit, multiprocessing.util
        res['exit hooks'] = (atexit._ncallbacks(), len(multiprocessing.util._finalizer_registry))   # (and fork hooks with them)
        return res
    import fastai.vision.all, fastai.distributed, nvidia.dali, nvidia.dali.plugin.pytorch   # (DALI's own exit hooks first)
    before = snapshot()
    IMPORT
    after = snapshot()
    changed = sorted(k for k in before if k in after and before[k] != after[k])
    added = sorted(k for k in after if k not in before and k.rsplit('.', 1)[0] in before)   # (new attributes of what was there)
    from fastai.torch_core import defaults
    env = {k: os.environ.get(k) for k in ('CUDA_DEVICE_MAX_CONNECTIONS',)}
    print('CHANGES ' + json.dumps(dict(changed=changed, added=added, env=env, callbacks=[c.__name__ for c in defaults.callbacks])))
''')

def changes(statement):
    "What `statement` changed, run in a fresh process after fastai's own imports"
    env = {k: v for k,v in os.environ.items() if k != 'CUDA_DEVICE_MAX_CONNECTIONS'}
    r = subprocess.run([sys.executable, '-c', SNAPSHOT.replace('IMPORT', statement)], capture_output=True, text=True, env=env, timeout=300)
    line = next((l[8:] for l in r.stdout.splitlines() if l.startswith('CHANGES ')), None)
    assert line is not None, r.stderr[-3000:]
    return json.loads(line)

def test_all_changes_what_patches_and_the_readme_list():
    from fastai_dali.patches import PATCHES
    c = changes('from fastai_dali.all import *')
    eq(c['added'], ['fastai.data.block.DataBlock.dali_dataloaders'])
    eq(set(c['changed']), {'fastai.distributed.DistributedTrainer._wrap_dl', 'defaults'})   # (defaults: its callbacks)
    eq(c['callbacks'][-1], 'DaliFastPathCallback')
    eq(c['env'], {'CUDA_DEVICE_MAX_CONNECTIONS': None})   # the work queues: only when asked (`set_work_queues`)
    eq(sorted(p.target for p in PATCHES), ['fastai.data.block.DataBlock.dali_dataloaders',
                                                'fastai.distributed.DistributedTrainer._wrap_dl', 'fastai.torch_core.defaults.callbacks'])
    readme = (Path(__file__).resolve().parents[1]/'README.md').read_text()
    for p in PATCHES: assert '.'.join(p.target.split('.')[-2:]) in readme, p.target   # ('DataBlock.dali_dataloaders', ...)

def test_modules_alone_change_nothing():
    mods = sorted(f.stem for f in (Path(__file__).resolve().parents[1]/'fastai_dali').glob('*.py')
                  if f.stem not in ('__init__', '_modidx', 'all', 'patches', 'demo'))   # (demo: a command that imports `all`)
    c = changes('; '.join(f'import fastai_dali.{m}' for m in mods))
    eq((c['added'], c['changed'], c['env']), ([], [], {'CUDA_DEVICE_MAX_CONNECTIONS': None}))
    assert 'DaliFastPathCallback' not in c['callbacks']

def test_work_queues_asked_after_the_imports():
    "`set_work_queues()` after the imports (the README's place) is in time: importing fastai, DALI and fastai_dali starts no CUDA"
    env = {k: v for k,v in os.environ.items() if k != 'CUDA_DEVICE_MAX_CONNECTIONS'}
    code = ('import warnings; warnings.simplefilter("error", UserWarning); from fastai.vision.all import *; '
            'from fastai_dali.all import *; print("QUEUES", set_work_queues())')
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, timeout=300)
    eq([l for l in r.stdout.splitlines() if l.startswith('QUEUES')], ['QUEUES 32'])

def test_commands_change_what_all_changes():
    "The bench and the demo, commands that run what users import, make `all`'s changes and no others (the README says so)"
    want = changes('from fastai_dali.all import *')
    c = changes('import fastai_dali.bench, fastai_dali.bench.cli, fastai_dali.demo')
    eq({k: c[k] for k in ('added', 'changed', 'env', 'callbacks')}, {k: want[k] for k in ('added', 'changed', 'env', 'callbacks')})

"""What `from fastai_dali.all import *` changes outside fastai_dali's own objects is what the README says, and nothing more:
in a fresh process, every attribute of every class and module of fastai and fastcore, fastai's `defaults` and the
environment, read before the import and after it."""
import json, subprocess, sys, textwrap

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
        return res
    import fastai.vision.all, fastai.distributed
    before = snapshot()
    from fastai_dali.all import *
    after = snapshot()
    changed = sorted(k for k in before if k in after and before[k] != after[k])
    added = sorted(k for k in after if k not in before and k.rsplit('.', 1)[0] in before)   # (new attributes of what was there)
    from fastai.torch_core import defaults
    env = {k: os.environ.get(k) for k in ('CUDA_DEVICE_MAX_CONNECTIONS',)}
    print('CHANGES ' + json.dumps(dict(changed=changed, added=added, env=env, callbacks=[c.__name__ for c in defaults.callbacks])))
''')

def test_import_changes_what_the_readme_lists():
    env = {k: v for k,v in __import__('os').environ.items() if k != 'CUDA_DEVICE_MAX_CONNECTIONS'}
    r = subprocess.run([sys.executable, '-c', SNAPSHOT], capture_output=True, text=True, env=env, timeout=300)
    line = next((l[8:] for l in r.stdout.splitlines() if l.startswith('CHANGES ')), None)
    assert line is not None, r.stderr[-3000:]
    c = json.loads(line)
    # the README's list ("What importing changes"): the work queues, DataBlock.dali_dataloaders, the fast path in fastai's
    # defaults.callbacks, fastai's distributed loader hook
    assert c['added'] == ['fastai.data.block.DataBlock.dali_dataloaders',
                          'fastai.distributed.DistributedTrainer._orig__wrap_dl'], c['added']   # (fastcore's `patch` keeps the one it replaced)
    assert set(c['changed']) == {'fastai.distributed.DistributedTrainer._wrap_dl', 'defaults', 'environ'}, c['changed']
    assert c['callbacks'][-1] == 'DaliFastPathCallback'
    # (on a machine where CUDA had started before the import the variable is left alone; not here: nothing touched CUDA)
    assert c['env'] == {'CUDA_DEVICE_MAX_CONNECTIONS': '32'}

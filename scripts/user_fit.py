"""A user's training script, as users write it, against the bench's Learner: which difference costs what.

The script (`vision_learner`, `to_bf16`, the model made channels_last by hand, `StepGraphCallback()`, fastai's progress bar
on, validation between epochs, one `fit(n)`), and variants that change one thing each, every one in a process of its own
on the same folder (6 photo classes, 300-500 x 240-400 px JPEGs; bs 128, 224 px, bf16):

    user            the script as written, torch's compile caches empty (a folder of its own: the first fit compiles cold)
    user_warm       the same in a new process, the caches as `user` left them (what a second run of the script pays)
    no_bar          without fastai's progress bar (`learn.no_bar()`)
    no_valid        validation skipped (a callback raising `CancelValidException`)
    plain_learner   `Learner(dls, create_vision_model(...), loss_func=CrossEntropyLossFlat())`: one parameter group
    channelslast    `learn.to_channelslast(amp_mode='bf16')` instead of `to_bf16()` + the model made channels_last
    bench           the bench's row: plain Learner, `to_channelslast`, no bar, no validation, `fit(1)` once an epoch
    defaults        the script without `StepGraphCallback` (a Learner's defaults), the bar on
    defaults_no_bar the same without the bar
    aug             the script with `RandomResizedCrop(224, min_scale=0.35)` and `aug_transforms()`
    queues8         the script without `set_work_queues()` (CUDA's 8 hardware work queues)
    cuda_first      the script with `torch.cuda.is_available()` before `set_work_queues()` (CUDA started first: the row
                    records the warning)
    no_compile_opt  the script with `StepGraphCallback(compile_opt=False)`: fastai's optimizer step captured uncompiled (its
                    compile, a graph per parameter group, is most of a warm process's first-epoch cost on a CPU:
                    `scripts/warm_compile.py`); after `user`, the model's compile caches warm
    one_graph_opt   the script with the optimizer's buckets compiled as one function (`OneGraphStep` below: one graph, not
                    one per parameter group; on a CPU its warm compile took 2.0 s against 3.8: `scripts/warm_compile.py`);
                    with `_warm` (`one_graph_opt_warm`), again in a new process, the caches as it left them

The script asks for 32 work queues (`set_work_queues()` after its imports, as the README says for `StepGraphCallback`).

Each epoch's training phase is timed from `before_train` to `after_train` (`torch.cuda.synchronize` at both ends); a row's
figure is the median of its epochs after the first (EPOCHS-1 of them: with EPOCHS 4, a true median of 3). With TRACE, the
`user` and `bench` rows also write a torch.profiler trace of batches 60-79 of their first epoch (untimed)
(`scripts/trace_diff.py A B` puts them side by side).

    python scripts/user_fit.py OUT ROOT [ARCH] [EPOCHS] [ROWS] [TRACE]   (a GPU; ARCH default resnet18, EPOCHS 4,
                                                                           ROWS comma-separated names, default all)

ROOT is written once (20,000 JPEGs, 500 of them for validation) if it has no `done` file. Writes OUT/user_fit_ARCH.json.
"""
import contextlib, json, os, statistics, subprocess, sys, tempfile, time

ROWS = ('user', 'user_warm', 'no_bar', 'no_valid', 'plain_learner', 'channelslast', 'bench', 'defaults', 'defaults_no_bar', 'aug',
        'queues8', 'cuda_first', 'no_compile_opt', 'one_graph_opt', 'one_graph_opt_warm')

def one_graph_step():
    "`StepGraphCallback` with the optimizer's step compiled as one function over all its buckets (one graph), not a function per bucket"
    import torch
    from fastai_dali.all import StepGraphCallback
    from warm_compile import all_buckets
    class OneGraphStep(StepGraphCallback):
        def _setup(self):
            super()._setup()
            opt = self.fit_learn.opt
            if not self.on or getattr(opt, 'one_graph', None) is not None: return
            f,step = torch.compile(all_buckets),opt.device_step
            @torch.no_grad()
            def device_step(bucket=None):   # (`device_step` gathers each bucket's arguments; the compiled function runs them all)
                got = []; step(bucket=lambda *a: got.append(a)); f(got)
            opt.device_step,opt.one_graph = device_step,f
    return OneGraphStep()

def make_data(root, n=20_000, n_valid=500):
    "The folder: `n` JPEGs of 300-500 x 240-400 px in 6 classes, `n_valid` of them for validation; reused when done"
    from pathlib import Path
    from fastai_dali.samples import make_image_folder, _photos
    root = Path(root)
    if (root/'done').exists(): return root
    k = len(_photos)
    make_image_folder(root, (n-n_valid)//k, n_valid//k, _photos, out_size=((300, 500), (240, 400)), procs=os.cpu_count())
    (root/'done').touch()
    return root

def one_row(row, root, arch, epochs, trace):
    "Row `row` in this process: a dict of its epochs' img/s"
    import warnings
    import torch
    if row == 'cuda_first': torch.cuda.is_available()   # (a question to CUDA before the imports: its driver starts with 8 queues)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        from fastai.vision.all import (vision_learner, Learner, create_vision_model, CrossEntropyLossFlat, Resize, Normalize,
                                       imagenet_stats, Callback, RandomResizedCrop, aug_transforms)
        from fastai_dali.bench.core import train_timer
        import torchvision.models as tvm
        from fastai_dali.all import DaliDataLoaders, StepGraphCallback, set_work_queues
        if row != 'queues8': set_work_queues()
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        arch_fn = getattr(tvm, arch)
        item,batch = ((RandomResizedCrop(224, min_scale=0.35), [*aug_transforms(), Normalize.from_stats(*imagenet_stats)]) if row == 'aug'
                      else (Resize(224), Normalize.from_stats(*imagenet_stats)))
        dls = DaliDataLoaders.from_folder(root, train='train', valid='valid', item_tfms=item, batch_tfms=batch, bs=128)
        dls.one_batch()
    queues_warning = [str(w.message)[:120] for w in caught if 'work queues' in str(w.message)]

    class Trace(Callback):
        "torch.profiler (with Python's stacks) over batches 60-79 of the first epoch, long after the capture (the timed epochs are the later ones)"
        order = 101
        done = False
        def before_batch(self):
            if self.training and self.epoch == 0 and self.iter == 60 and not self.done:   # (once: the bench row's fits each have an epoch 0)
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA], with_stack=True)
                self.prof.__enter__()
        def after_batch(self):
            if self.training and self.epoch == 0 and self.iter == 79:
                sync(); self.prof.__exit__(None, None, None)
                self.prof.export_chrome_trace(trace); self.done = True   # (a name ending .gz: written gzipped)

    graphs = ([] if row.startswith('defaults') else [one_graph_step()] if row.startswith('one_graph_opt')
              else [StepGraphCallback(compile_opt=row != 'no_compile_opt')])
    name,row = row,row.replace('_warm', '')
    if row in ('queues8', 'cuda_first', 'no_compile_opt', 'one_graph_opt'): row = 'user'
    if row in ('plain_learner', 'bench'):
        learn = Learner(dls, create_vision_model(arch_fn, dls.c, pretrained=False), loss_func=CrossEntropyLossFlat(), cbs=graphs)
    else: learn = vision_learner(dls, arch_fn, pretrained=False, cbs=graphs)
    if row in ('channelslast', 'bench'): learn.to_channelslast(amp_mode='bf16')
    else:
        learn.to_bf16()
        learn.model.to(memory_format=torch.channels_last)
    # each epoch's training phase timed (synchronized), the fit's start split: to its first batch, each of its first 8
    timer = train_timer(validate=row not in ('no_valid', 'bench'), split=8); cbs = [timer] + ([Trace()] if trace else [])
    bar = row not in ('no_bar', 'bench', 'defaults_no_bar')
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as fit_caught:   # (what the user's console shows during the fit, once each)
        warnings.simplefilter('default')
        if row == 'bench':
            ips,first = [],None
            for e in range(epochs):
                with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3, cbs=cbs)
                ips,first = ips + timer.runs,first or timer.first
        else:
            with (learn.no_bar() if not bar else contextlib.nullcontext()): learn.fit(epochs, 1e-3, cbs=cbs)
            ips,first = timer.runs,timer.first
    return dict(row=name, arch=arch, epochs_ips=ips, epochs_s=[timer.n/r for r in ips], median_ips=statistics.median(ips[1:]) if len(ips) > 1 else ips[0],
                fit_s=time.perf_counter()-t0, device=torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu',
                CUDA_DEVICE_MAX_CONNECTIONS=os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'), queues_warning=queues_warning,
                first_epoch=first, compile=_compile_stats(), fit_warnings=sorted({str(w.message)[:160] for w in fit_caught}))

def _compile_stats():
    "torch.compile's own account of the process: seconds per phase, and its caches' hits and misses"
    try:
        from torch._dynamo.utils import compile_times, counters
        return dict(times=compile_times(repr='str', aggregate=True)[-1500:],
                    caches={k: dict(v) for k,v in counters.items() if k in ('stats', 'inductor', 'aot_autograd') and v} )
    except Exception as e: return repr(e)

def main(out, root, arch='resnet18', epochs=4, rows=ROWS, trace=False):
    os.makedirs(out, exist_ok=True)
    make_data(root)
    res = []
    for row in rows:
        tr = os.path.join(out, f'trace_user_fit_{arch}_{row}.json.gz') if trace and row in ('user', 'bench') else None
        code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); from user_fit import one_row; "
                f"print('ROW ' + json.dumps(one_row({row!r}, {str(root)!r}, {arch!r}, {epochs}, {tr!r})))")
        # torch's compile caches: a folder of this run's, empty for the first row (cold), kept for the next ones
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tempfile.gettempdir(), 'user_fit_inductor_cache'))
        env.pop('CUDA_DEVICE_MAX_CONNECTIONS', None)   # (the script's own call decides)
        if row == rows[0] and not row.endswith('_warm'): subprocess.run(['rm', '-rf', env['TORCHINDUCTOR_CACHE_DIR']])
        p = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env)
        line = next((l[4:] for l in p.stdout.splitlines() if l.startswith('ROW ')), None)
        if line is None: print(f'{row}: failed\n{p.stderr[-3000:]}', flush=True); continue
        res.append(json.loads(line)); print(line, flush=True)
        with open(os.path.join(out, f'user_fit_{arch}.json'), 'w') as f: json.dump(res, f, indent=1)
    return res

if __name__ == '__main__':
    a = sys.argv[1:]
    if len(a) < 2: sys.exit(__doc__)
    main(a[0], a[1], a[2] if len(a) > 2 else 'resnet18', int(a[3]) if len(a) > 3 else 4,
         tuple(a[4].split(',')) if len(a) > 4 and a[4] else ROWS, len(a) > 5 and a[5] == '1')

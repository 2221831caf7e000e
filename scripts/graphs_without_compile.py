"""CUDA graphs without `torch.compile`: what capturing the model's own (eager) kernels gives, beside the compiled graphs
`CudaGraphCallback` replays, in fastai's loop and in a plain loop; and where the plain loop's kernels go (a trace).

Rows (img/s; each row in a process of its own, so that a capture that crashes costs that row only: a warm-up epoch,
then 2 timed ones, the median; bf16, channels_last, bs 128,
224 px, 10,000 JPEGs of `make_bench_dataset`, random init):
- `learn.fit` on DaliDataLoaders with a Learner's defaults (the fast path), alone; with `EagerGraphs` (below); with
  `CudaGraphCallback` (forward and backward compiled, mode 'reduce-overhead');
- the plain loop (fused AdamW with fastai's hyper-parameters) on synthetic GPU batches: compiled graphs (the limit the
  other rows are measured against), the model's eager kernels as graphs (`make_graphed_callables`), and the whole step
  (forward, loss, backward, AdamW with `capturable`) as one CUDA graph; the whole-step graph also on DaliDataLoaders'
  batches (each copied into the graph's input); and the whole step again with the model's kernels compiled
  (`torch.compile`, mode 'default': Triton's fused kernels, captured in the one graph with the rest), with torch's
  AdamW and with fastai's Adam as `ForeachAdam.device_step` (its numbers written by `device_numbers` before each replay),
  that step's foreach ops also compiled (`device_step(bucket=torch.compile(bucket_step))`: Inductor fuses them,
  rows 19 and 20; in fastai's loop `StepGraphCallback(compile_opt=True)`, rows 21 and 22); and the batch's layout
  swapped (fastai's `ChannelsLast` makes the model channels_last but leaves the batches NCHW, the plain loop feeds
  channels_last ones): the plain whole step fed NCHW batches (row 23), fastai's fed channels_last ones (row 24);
- `learn.fit` with `StepGraphCallback` (the whole step one graph in fastai's loop, fastai's Adam as `device_step`): on
  synthetic batches (`ForeachAdam` + `DeviceLossCallback`), on DaliDataLoaders with a Learner's defaults (the model's
  kernels compiled, and not), and with RandomResizedCrop + aug_transforms() (beside `CudaGraphCallback` on the same);
  and with the loader's threads (6, MLPerf's per GPU) and prefetch depth (3) changed. Since `compile_opt` follows
  `compile` (2026-12-05), these rows compile the optimizer's foreach ops too, as rows 21 and 22 do; before, they did not.

`EagerGraphs` is a prototype callback: at the first training batch it captures the model's forward and backward as
they run eagerly (`torch.cuda.make_graphed_callables`, with fastai's autocast made cache-free, which that requires),
then fastai's loop replays them; the batch-norm buffers are put back after the capture's warm-up batches.

Then torch.profiler traces (20 batches each) of the plain loop's compiled graphs, its whole-step graph (eager kernels; and
compiled, with fastai's Adam), `StepGraphCallback`'s fit on synthetic batches, and the fit with
`EagerGraphs`, split by kind of kernel (`scripts/trace_kernel_split.py`).

    python scripts/graphs_without_compile.py OUT [ARCHS] [ROOT] [TRACES] [ROWS]   (a GPU; ARCHS default resnet18,resnet50;
                                                                                  TRACES 1: the traces too, or their names, e.g.
                                                                                  plain_whole_step_fastai_adam,step_graph_synthetic;
                                                                                  ROWS: row numbers, e.g. 3,10,12,13)

Writes OUT/graphs_without_compile.json, the traces OUT/trace_*.json.gz, and prints a markdown table per arch.
"""
import json, os, sys, time, traceback, tempfile
import torch
from fastai.vision.all import (Resize, Normalize, imagenet_stats, models, DataLoaders, Callback, create_vision_model,
                               RandomResizedCrop, aug_transforms)
from fastai_dali.data import DaliDataLoaders
from fastai_dali.training import DeviceLossCallback
from fastai_dali.graphs import CudaGraphCallback
from fastai_dali.optimizer import ForeachAdam, bucket_step
from functools import partial
from fastai_dali.graphs import StepGraphCallback
from fastai_dali.samples import make_bench_dataset
from fastai_dali.bench.training import fit_epochs, torch_loop_epochs, torch_optimizer, SyntheticDL, ROW_DEFAULT
sys.path.insert(0, os.path.dirname(__file__))
from trace_kernel_split import split

class ChannelsLastBatches(Callback):
    "Each training batch's images made channels_last before the step (as the plain loop feeds them), where fastai's `ChannelsLast` leaves them NCHW"
    order = 11   # (before `StepGraphCallback`, whose graph then copies them into a channels_last input)
    def before_batch(self): self.learn.xb = tuple(x.contiguous(memory_format=torch.channels_last) if x.ndim == 4 else x for x in self.xb)

class EagerGraphs(Callback):
    "Training batches' forward and backward as the model runs them eagerly, captured once (`make_graphed_callables`) and replayed; other shapes, validation: eager"
    order = 12
    def __init__(self): super().__init__(); self.shape = None   # (the captured batch's shape: captured once, for every fit)
    def before_fit(self):
        mp = getattr(self.learn, 'mixed_precision', None)
        if mp is not None and hasattr(mp, 'autocast'):  # (a capture under autocast needs its cache off)
            mp.autocast = torch.autocast('cuda', dtype=mp.autocast.fast_dtype, cache_enabled=False)
    def before_batch(self):
        if not self.training or self.shape is not None: return
        m,x = self.learn.model,self.learn.xb[0].as_subclass(torch.Tensor)
        saved = {k: v.clone() for k,v in m.state_dict().items()}   # (the warm-up batches move batch-norm's statistics)
        torch.cuda.synchronize()
        torch.cuda.make_graphed_callables(m, (x.clone(),), num_warmup_iters=3)
        with torch.no_grad(): m.load_state_dict(saved)   # (copied in place: the graphs' memory stays)
        self.shape = x.shape

def plain_graphed(dl, arch, n_out, whole_step=False, batches=None, compiled=False, fastai_adam=False, compiled_adam=False, nchw_input=False):
    "A plain loop (fused AdamW, bf16 autocast, channels_last) over `dl` with the model's eager kernels as CUDA graphs (`make_graphed_callables`), or with `whole_step` the whole step (forward, loss, backward, AdamW) one CUDA graph, the batch copied into its input (`compiled`: the model's kernels `torch.compile`'s, mode 'default', captured with the rest; `fastai_adam`: fastai's Adam as `ForeachAdam`'s `device_step` instead of torch's AdamW, its numbers written before each replay by `device_numbers`; `nchw_input`: the batches NCHW, as fastai's loop gives them, the model channels_last all the same); returns an epoch function (img/s)"
    mf = torch.channels_last
    # (`.train()`: `create_vision_model` leaves the body in eval mode, fastai's `dummy_eval`; fastai's fit undoes it)
    m = create_vision_model(arch, n_out, pretrained=False).cuda().to(memory_format=mf).train()
    xf = torch.contiguous_format if nchw_input else mf   # (the batch's layout: fastai's `ChannelsLast` converts the model only)
    if compiled: m = torch.compile(m)   # (Triton kernels, no graphs of its own: the capture below takes them)
    lf = torch.nn.CrossEntropyLoss()
    x0,y0 = next(iter(dl))
    sx = x0.as_subclass(torch.Tensor).contiguous(memory_format=xf).clone(); sy = y0.as_subclass(torch.Tensor).long().clone()
    ac = lambda: torch.autocast('cuda', dtype=torch.bfloat16, cache_enabled=False)
    if whole_step:
        from fastai.torch_core import norm_bias_params
        nb = {id(p) for p in norm_bias_params(m)}
        if fastai_adam:
            from fastai_dali.optimizer import ForeachAdam
            opt = ForeachAdam(list(m.parameters()), lr=1e-3)   # (fastai's defaults: mom 0.9, sqr_mom 0.99, eps 1e-5, wd 0.01)
            for p in m.parameters():
                if id(p) in nb: opt.state[p]['do_wd'] = False   # (fastai's `wd_bn_bias=False`)
            opt_step,zero = opt.device_step,lambda: [setattr(p, 'grad', None) for p in m.parameters()]
            if compiled_adam:   # (its first eager step makes the states; the warm-up steps below compile it)
                zero()
                with ac(): lf(m(sx), sy).backward()
                opt.device_numbers(); opt.device_step()
                opt_step = partial(opt.device_step, bucket=torch.compile(bucket_step, fullgraph=True))
        else:
            opt = torch.optim.AdamW([dict(params=[p for p in m.parameters() if id(p) not in nb]),
                                     dict(params=[p for p in m.parameters() if id(p) in nb], weight_decay=0.)],
                                    lr=torch.tensor(1e-3, device='cuda'), betas=(0.9, 0.99), eps=1e-5, weight_decay=0.01, capturable=True, foreach=True)
            opt_step,zero = opt.step,lambda: opt.zero_grad(set_to_none=True)
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                zero()
                with ac(): loss = lf(m(sx), sy)
                loss.backward()
                if fastai_adam: opt.device_numbers()
                opt_step(); del loss   # (no autograd graph kept alive into the capture)
        torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph(); zero()
        with torch.cuda.graph(g):
            with ac(): sloss = lf(m(sx), sy)
            sloss.backward(); opt_step()
        if fastai_adam: opt.captured = opt.plan_key()   # (`device_numbers` refuses a changed structure from now on)
        def step(x, y):
            sx.copy_(x, non_blocking=True); sy.copy_(y, non_blocking=True)
            if fastai_adam: opt.device_numbers()   # (this step's rates and bias corrections, before the replay reads them)
            g.replay()
    else:
        opt = torch_optimizer(m, 'adamw_fused')
        with ac(): m = torch.cuda.make_graphed_callables(m, (sx,), num_warmup_iters=3)
        def step(x, y):
            with ac(): loss = lf(m(x), y)
            opt.zero_grad(set_to_none=False); loss.backward(); opt.step()
    def epoch():
        torch.cuda.synchronize(); t0,n = time.perf_counter(),0
        for i,(x,y) in enumerate(dl):
            if batches is not None and i == batches: break
            x = x.as_subclass(torch.Tensor).contiguous(memory_format=xf); y = y.as_subclass(torch.Tensor).long()
            if x.shape != sx.shape: continue   # (a last, smaller batch)
            step(x, y); n += len(x)
        torch.cuda.synchronize(); return n/(time.perf_counter()-t0)
    return epoch

def trace(fn, epoch_fn, n=20):
    "torch.profiler over `n` batches of `epoch_fn` (after one untimed epoch): chrome trace to `fn`; the kernel split"
    from torch.profiler import profile, ProfilerActivity
    import gzip, tempfile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof: epoch_fn()
    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(f'{d}/t.json')
        with open(f'{d}/t.json') as f, gzip.open(fn, 'wt') as g: g.write(f.read())
    ms,cnt,other = split(fn, n)
    return dict(ms_per_batch={k: round(v, 3) for k,v in ms.items()}, kernels_per_batch={k: round(v, 1) for k,v in cnt.items()},
                other={k: round(v, 3) for k,v in other.most_common(6)}, total_ms=round(sum(ms.values()), 3))

LIMIT = 'plain loop, synthetic, compiled graphs (the limit)'
OWN = "DaliDataLoaders, fastai's own loop (dls.fast_path=False)"
ROWS = (ROW_DEFAULT, f'{ROW_DEFAULT} + EagerGraphs', f'{ROW_DEFAULT} + CudaGraphCallback', LIMIT,
        'plain loop, synthetic, eager kernels as graphs', 'plain loop, synthetic, whole step one graph',
        'plain loop, DaliDataLoaders, whole step one graph', OWN,
        'plain loop, synthetic, whole step one graph, compiled kernels', 'plain loop, DaliDataLoaders, whole step one graph, compiled kernels',
        'plain loop, synthetic, whole step one graph, compiled kernels, ForeachAdam.device_step', 'plain loop, DaliDataLoaders, whole step one graph, compiled kernels, ForeachAdam.device_step',
        'model only (synthetic), ForeachAdam, DeviceLossCallback, StepGraphCallback', f'{ROW_DEFAULT} + StepGraphCallback',
        f'{ROW_DEFAULT} + StepGraphCallback(compile=False)', f'{ROW_DEFAULT} + StepGraphCallback, RandomResizedCrop + aug_transforms()',
        f'{ROW_DEFAULT} + CudaGraphCallback, RandomResizedCrop + aug_transforms()',
        f'{ROW_DEFAULT} + StepGraphCallback, num_threads=6', f'{ROW_DEFAULT} + StepGraphCallback, prefetch=3',
        'plain loop, synthetic, whole step one graph, compiled kernels, ForeachAdam.device_step compiled',
        'plain loop, DaliDataLoaders, whole step one graph, compiled kernels, ForeachAdam.device_step compiled',
        'model only (synthetic), ForeachAdam, DeviceLossCallback, StepGraphCallback(compile_opt=True)',
        f'{ROW_DEFAULT} + StepGraphCallback(compile_opt=True)',
        'plain loop, synthetic, whole step one graph, compiled kernels, ForeachAdam.device_step, NCHW batches (as fastai gives them)',
        'model only (synthetic), ForeachAdam, DeviceLossCallback, StepGraphCallback, channels_last batches')
TRACES = {'plain_compiled': LIMIT, 'plain_whole_step': ROWS[5], 'plain_eager_graphs': ROWS[4],
          # the plain loop's whole step one graph against fastai's (`StepGraphCallback`), both on synthetic batches, both
          # the model compiled and fastai's Adam as `device_step`: the kernels fastai's loop adds to, or takes from, the graph
          'plain_whole_step_fastai_adam': ROWS[10], 'step_graph_synthetic': ROWS[12]}

def one_row(out, a, k, root, epochs=3):
    "Row `k` for arch `a` in this process: a warm-up epoch, then `epochs`-1 timed ones, as a JSON line (a trace of 20 batches instead where `k` is in `TRACES`)"
    import faulthandler; faulthandler.enable()
    kw = dict(item_tfms=Resize(224), batch_tfms=Normalize.from_stats(*imagenet_stats), bs=128, device='cuda')
    dls = DaliDataLoaders.from_folder(root, **kw)
    rrc = lambda: DaliDataLoaders.from_folder(root, **{**kw, 'item_tfms': RandomResizedCrop(224, min_scale=0.35),   # (the bench's augmented rows)
                                                       'batch_tfms': [*aug_transforms(), Normalize.from_stats(*imagenet_stats)]})
    arch = getattr(models, a)
    sdl = SyntheticDL(bs=128, size=224, n_batches=20 if k in TRACES else len(dls.train), c=dls.c, device='cuda')
    make = {ROWS[0]: lambda: fit_epochs(dls, arch, dls.c, fast_path=True),
            ROWS[1]: lambda: fit_epochs(dls, arch, dls.c, fast_path=True, cbs=[EagerGraphs()]),
            ROWS[2]: lambda: fit_epochs(dls, arch, dls.c, fast_path=True, cbs=[CudaGraphCallback()]),
            LIMIT: lambda: torch_loop_epochs(sdl, arch, dls.c, opt='adamw_fused', graphs=True),
            ROWS[4]: lambda: plain_graphed(sdl, arch, dls.c),
            ROWS[5]: lambda: plain_graphed(sdl, arch, dls.c, whole_step=True),
            ROWS[6]: lambda: plain_graphed(dls.train, arch, dls.c, whole_step=True),
            OWN: lambda: fit_epochs(dls, arch, dls.c),
            ROWS[8]: lambda: plain_graphed(sdl, arch, dls.c, whole_step=True, compiled=True),
            ROWS[9]: lambda: plain_graphed(dls.train, arch, dls.c, whole_step=True, compiled=True),
            ROWS[10]: lambda: plain_graphed(sdl, arch, dls.c, whole_step=True, compiled=True, fastai_adam=True),
            ROWS[11]: lambda: plain_graphed(dls.train, arch, dls.c, whole_step=True, compiled=True, fastai_adam=True),
            ROWS[12]: lambda: fit_epochs(DataLoaders(sdl, sdl), arch, dls.c, opt_func=ForeachAdam, cbs=[DeviceLossCallback()], compile='step'),
            ROWS[13]: lambda: fit_epochs(dls, arch, dls.c, fast_path=True, compile='step'),
            ROWS[14]: lambda: fit_epochs(dls, arch, dls.c, fast_path=True, cbs=[StepGraphCallback(compile=False)]),
            ROWS[15]: lambda: fit_epochs(rrc(), arch, dls.c, fast_path=True, compile='step'),
            ROWS[16]: lambda: fit_epochs(rrc(), arch, dls.c, fast_path=True, cbs=[CudaGraphCallback()]),
            # the loader beside the graphs: fewer DALI threads (MLPerf's 6 a GPU), one more batch ahead
            ROWS[17]: lambda: fit_epochs(DaliDataLoaders.from_folder(root, **kw, num_threads=6), arch, dls.c, fast_path=True, compile='step'),
            ROWS[18]: lambda: fit_epochs(DaliDataLoaders.from_folder(root, **kw, prefetch=3), arch, dls.c, fast_path=True, compile='step'),
            # fastai's Adam with its foreach ops compiled (fused by Inductor) inside the whole-step graph: what a fused step would give
            ROWS[19]: lambda: plain_graphed(sdl, arch, dls.c, whole_step=True, compiled=True, fastai_adam=True, compiled_adam=True),
            ROWS[20]: lambda: plain_graphed(dls.train, arch, dls.c, whole_step=True, compiled=True, fastai_adam=True, compiled_adam=True),
            # the same in fastai's loop: `StepGraphCallback` with the optimizer's foreach ops compiled (rows 12 and 13 too, now the default)
            ROWS[21]: lambda: fit_epochs(DataLoaders(sdl, sdl), arch, dls.c, opt_func=ForeachAdam, cbs=[DeviceLossCallback(), StepGraphCallback(compile_opt=True)]),
            ROWS[22]: lambda: fit_epochs(dls, arch, dls.c, fast_path=True, cbs=[StepGraphCallback(compile_opt=True)]),
            # the batch's layout: fastai's `ChannelsLast` makes the model channels_last, not the batches (NCHW, as the
            # loader and `SyntheticDL` give them), where the plain loop feeds channels_last batches: each loop with the other's
            ROWS[23]: lambda: plain_graphed(sdl, arch, dls.c, whole_step=True, compiled=True, fastai_adam=True, nchw_input=True),
            ROWS[24]: lambda: fit_epochs(DataLoaders(sdl, sdl), arch, dls.c, opt_func=ForeachAdam, cbs=[DeviceLossCallback(), ChannelsLastBatches()], compile='step')}
    if k in TRACES:
        ep = make[TRACES[k]](); ep(); ep()
        r = dict(arch=a, trace=k, **trace(f'{out}/trace_{a}_{k}.json.gz', ep, 20))
    else:
        ep = make[k](); runs = [ep() for _ in range(epochs)]
        r = dict(arch=a, row=k, runs=runs[1:], median=float(sorted(runs[1:])[len(runs[1:])//2]) if len(runs) > 2 else runs[-1])
    r['CUDA_DEVICE_MAX_CONNECTIONS'] = os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')   # (in force for this row: the caller's environment; CUDA's 8 where unset)
    print(json.dumps(r), flush=True)

def main(out, archs='resnet18,resnet50', root=os.path.join(tempfile.gettempdir(), 'bt/data_10000'), traces='1', rows=None):
    "Each row (and for resnet18 each trace) in a process of its own: a crash (a capture that fails) costs that row only"
    import subprocess
    make_bench_dataset(root, 10000)
    fn = f'{out}/graphs_without_compile.json'
    res = json.load(open(fn)) if os.path.exists(fn) else {'torch': torch.__version__, 'gpu': torch.cuda.get_device_name()}
    for a in archs.split(','):
        for k in [r for r in ROWS if rows is None or str(ROWS.index(r)) in rows.split(',')] + [t for t in TRACES if a == 'resnet18' and (traces == '1' or t in traces.split(','))]:
            t = time.time()
            p = subprocess.run([sys.executable, __file__, '--row', out, a, k, root], capture_output=True, text=True)
            line = next((l for l in p.stdout.splitlines()[::-1] if l.startswith('{')), None)
            if line is None:
                err = '\n'.join(l for l in p.stderr.splitlines() if 'nvjpeg2k' not in l and 'nvtiff' not in l and 'warn' not in l.lower())[-1500:]
                res.setdefault('errors', {})[f'{a}: {k}'] = err; print(f'{a}: {k} FAILED (rc {p.returncode})\n{err}', flush=True)
            else:
                r = json.loads(line); res.setdefault(a, {})[k] = r; print(f'{time.time()-t:.0f} s', line, flush=True)
            json.dump(res, open(fn, 'w'), indent=1)
        if a in res:
            lim = res[a].get(LIMIT, {}).get('median', float('nan'))
            print(f"\n### {a}\n\n| row | img/s | epochs | ÷ the limit |\n|---|---:|---:|---:|")
            for k,r in res[a].items():
                if 'median' in r: print(f"| {k} | {r['median']:,.0f} | {' / '.join(f'{x:,.0f}' for x in r['runs'])} | {r['median']/lim:.2f} |", flush=True)

if __name__ == '__main__':
    if sys.argv[1] == '--row': one_row(*sys.argv[2:])
    else: main(*sys.argv[1:])

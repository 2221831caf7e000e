"""CUDA graphs without `torch.compile`: what capturing the model's own (eager) kernels gives, beside the compiled graphs
`CudaGraphCallback` replays, in fastai's loop and in a plain loop; and where the plain loop's kernels go (a trace).

Rows (img/s, one epoch a round, `fit_rounds`: a warm-up epoch, then 2 rounds, the median; bf16, channels_last, bs 128,
224 px, 10,000 JPEGs of `make_bench_dataset`, random init):
- `learn.fit` on DaliDataLoaders with a Learner's defaults (the fast path), alone; with `EagerGraphs` (below); with
  `CudaGraphCallback` (forward and backward compiled, mode 'reduce-overhead');
- the plain loop (fused AdamW with fastai's hyper-parameters) on synthetic GPU batches: compiled graphs (the limit the
  other rows are measured against), the model's eager kernels as graphs (`make_graphed_callables`), and the whole step
  (forward, loss, backward, AdamW with `capturable`) as one CUDA graph; the whole-step graph also on DaliDataLoaders'
  batches (each copied into the graph's input).

`EagerGraphs` is a prototype callback: at the first training batch it captures the model's forward and backward as
they run eagerly (`torch.cuda.make_graphed_callables`, with fastai's autocast made cache-free, which that requires),
then fastai's loop replays them; the batch-norm buffers are put back after the capture's warm-up batches.

Then torch.profiler traces (20 batches each) of the plain loop's compiled graphs, its whole-step graph, and the fit with
`EagerGraphs`, split by kind of kernel (`scripts/trace_kernel_split.py`).

    python scripts/graphs_without_compile.py OUT [ARCHS] [ROOT]     (a GPU; ARCHS default resnet18,resnet50)

Writes OUT/graphs_without_compile.json, the traces OUT/trace_*.json.gz, and prints a markdown table per arch.
"""
import json, os, sys, time, traceback
import torch
from fastai.vision.all import Resize, Normalize, imagenet_stats, models, DataLoaders, Callback, create_vision_model
from fastai_dali.data import DaliDataLoaders
from fastai_dali.training import CudaGraphCallback
from fastai_dali.demo import make_bench_dataset
from fastai_dali.bench.training import fit_epochs, torch_loop_epochs, torch_optimizer, fit_rounds, SyntheticDL, ROW_DEFAULT
sys.path.insert(0, os.path.dirname(__file__))
from trace_kernel_split import split

class EagerGraphs(Callback):
    "Training batches' forward and backward as the model runs them eagerly, captured once (`make_graphed_callables`) and replayed; other shapes, validation: eager"
    order = 12
    def before_fit(self):
        mp = getattr(self.learn, 'mixed_precision', None)
        if mp is not None and hasattr(mp, 'autocast'):  # (a capture under autocast needs its cache off)
            mp.autocast = torch.autocast('cuda', dtype=mp.autocast.fast_dtype, cache_enabled=False)
        self.shape = getattr(self, 'shape', None)
    def before_batch(self):
        if not self.training or self.shape is not None: return
        m,x = self.learn.model,self.learn.xb[0].as_subclass(torch.Tensor)
        saved = {k: v.clone() for k,v in m.state_dict().items()}   # (the warm-up batches move batch-norm's statistics)
        torch.cuda.synchronize()
        torch.cuda.make_graphed_callables(m, (x.clone(),), num_warmup_iters=3)
        with torch.no_grad(): m.load_state_dict(saved)   # (copied in place: the graphs' memory stays)
        self.shape = x.shape

def plain_graphed(dl, arch, n_out, whole_step=False, batches=None):
    "A plain loop (fused AdamW, bf16 autocast, channels_last) over `dl` with the model's eager kernels as CUDA graphs (`make_graphed_callables`), or with `whole_step` the whole step (forward, loss, backward, AdamW) one CUDA graph, the batch copied into its input; returns an epoch function (img/s)"
    mf = torch.channels_last
    m = create_vision_model(arch, n_out, pretrained=False).cuda().to(memory_format=mf)
    lf = torch.nn.CrossEntropyLoss()
    x0,y0 = next(iter(dl))
    sx = x0.as_subclass(torch.Tensor).contiguous(memory_format=mf).clone(); sy = y0.as_subclass(torch.Tensor).long().clone()
    ac = lambda: torch.autocast('cuda', dtype=torch.bfloat16, cache_enabled=False)
    if whole_step:
        from fastai.torch_core import norm_bias_params
        nb = {id(p) for p in norm_bias_params(m)}
        opt = torch.optim.AdamW([dict(params=[p for p in m.parameters() if id(p) not in nb]),
                                 dict(params=[p for p in m.parameters() if id(p) in nb], weight_decay=0.)],
                                lr=torch.tensor(1e-3, device='cuda'), betas=(0.9, 0.99), eps=1e-5, weight_decay=0.01, capturable=True, foreach=True)
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                with ac(): loss = lf(m(sx), sy)
                loss.backward(); opt.step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph(); opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(g):
            with ac(): sloss = lf(m(sx), sy)
            sloss.backward(); opt.step()
        def step(x, y): sx.copy_(x, non_blocking=True); sy.copy_(y, non_blocking=True); g.replay()
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
            x = x.as_subclass(torch.Tensor).contiguous(memory_format=mf); y = y.as_subclass(torch.Tensor).long()
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

def main(out, archs='resnet18,resnet50', root='/tmp/bt/data_10000'):
    make_bench_dataset(root, 10000)
    kw = dict(item_tfms=Resize(224), batch_tfms=Normalize.from_stats(*imagenet_stats), bs=128, device='cuda')
    dls = DaliDataLoaders.from_folder(root, **kw)
    res = {'torch': torch.__version__, 'gpu': torch.cuda.get_device_name()}
    LIMIT = 'plain loop, synthetic, compiled graphs (the limit)'
    for a in archs.split(','):
        t = time.time(); arch = getattr(models, a)
        sdl = SyntheticDL(bs=128, size=224, n_batches=len(dls.train), c=dls.c, device='cuda')
        rows = {ROW_DEFAULT: lambda: fit_epochs(dls, arch, dls.c, fast_path=True),
                f'{ROW_DEFAULT} + EagerGraphs': lambda: fit_epochs(dls, arch, dls.c, fast_path=True, cbs=[EagerGraphs()]),
                f'{ROW_DEFAULT} + CudaGraphCallback': lambda: fit_epochs(dls, arch, dls.c, fast_path=True, cbs=[CudaGraphCallback()]),
                LIMIT: lambda: torch_loop_epochs(sdl, arch, dls.c, opt='adamw_fused', graphs=True),
                'plain loop, synthetic, eager kernels as graphs': lambda: plain_graphed(sdl, arch, dls.c),
                'plain loop, synthetic, whole step one graph': lambda: plain_graphed(sdl, arch, dls.c, whole_step=True),
                'plain loop, DaliDataLoaders, whole step one graph': lambda: plain_graphed(dls.train, arch, dls.c, whole_step=True)}
        ok = {}
        for k,f in rows.items():   # (a row that fails to build is reported, not fatal)
            try: ep = f(); ok[k] = (lambda e: lambda: e)(ep)
            except Exception: res.setdefault('errors', {})[f'{a}: {k}'] = traceback.format_exc()[-2000:]; print(f'{a}: {k} FAILED\n{traceback.format_exc()[-1500:]}', flush=True)
        wrapped = {}
        for k,mk in ok.items():
            ep = mk()
            def safe(ep=ep, k=k):
                try: return ep()
                except Exception: print(f'{a}: {k} FAILED in an epoch\n{traceback.format_exc()[-1500:]}', flush=True); return float('nan')
            wrapped[k] = (lambda s: lambda: s)(safe)
        med,runs = fit_rounds(wrapped, epochs=3)
        res[a] = dict(median=med, rounds=runs, seconds=time.time()-t)
        lim = med.get(LIMIT, float('nan'))
        print(f"\n### {a} ({time.time()-t:.0f} s)\n\n| row | img/s | rounds | ÷ the limit |\n|---|---:|---:|---:|")
        for k,v in med.items(): print(f"| {k} | {v:,.0f} | {' / '.join(f'{x:,.0f}' for x in runs[k])} | {v/lim:.2f} |", flush=True)
        json.dump(res, open(f'{out}/graphs_without_compile.json', 'w'), indent=1)
        if a != 'resnet18': continue
        tr = res['traces'] = {}
        for name,mk in {'plain_compiled': lambda: torch_loop_epochs(SyntheticDL(bs=128, size=224, n_batches=20, c=dls.c, device='cuda'), arch, dls.c, opt='adamw_fused', graphs=True),
                        'plain_whole_step': lambda: plain_graphed(SyntheticDL(bs=128, size=224, n_batches=20, c=dls.c, device='cuda'), arch, dls.c, whole_step=True),
                        'plain_eager_graphs': lambda: plain_graphed(SyntheticDL(bs=128, size=224, n_batches=20, c=dls.c, device='cuda'), arch, dls.c)}.items():
            try:
                ep = mk(); ep(); ep()   # (warm: compiled, captured)
                tr[name] = trace(f'{out}/trace_{a}_{name}.json.gz', ep, 20); print(name, json.dumps(tr[name]), flush=True)
            except Exception: print(f'trace {name} FAILED\n{traceback.format_exc()[-1500:]}', flush=True)
        json.dump(res, open(f'{out}/graphs_without_compile.json', 'w'), indent=1)

if __name__ == '__main__': main(*sys.argv[1:])

"""The loader beside `StepGraphCallback`: where a graphed `learn.fit` on `DaliDataLoaders` loses to the same fit on
synthetic batches (a GPU).

Each variant in a process of its own (resnet18 by default; bf16, channels_last, bs 128, 224 px, 10,000 JPEGs of
`make_bench_dataset`, the fast path + `StepGraphCallback`): a warm-up fit of one epoch, a timed one, then one epoch under
cProfile, whose DALI `share_outputs` time is the host waiting for the loader's next batch. Variants: synthetic batches
(no loader), the loader's defaults, `prefetch` 3, 4 and 6, `num_threads` 6 and 8, DALI's dynamic executor,
`CUDA_DEVICE_MAX_CONNECTIONS` 8 (CUDA's default) and 32 (what `set_work_queues()` asks for), the decoder without
interpolated chroma (`jpeg_fancy_upsampling=False`), `hw_decoder_load` 0 and 0.65, the batches fetched by a thread
of their own (`fetch_ahead`). For the variants in
`TRACED`, a torch.profiler trace of one epoch, its kernels split by CUDA stream (the graph's, DALI's: each stream's
kernels, their union, how much of them overlap), the loader's waits (`loader_waits`) and what the graph's stream does
between replays (`between_replays`), per batch; with Python stacks where `TRACE_STACKS=1`. `python scripts/step_graph_loader.py --trace FILE BATCHES` reads a saved trace again.

    python scripts/step_graph_loader.py OUT [ARCH] [ROOT] [VARIANTS]   (VARIANTS: comma-separated names, default all; none has a comma)

Writes OUT/step_graph_loader.json and OUT/trace_step_graph_loader_ARCH_K.json.gz (K: the traced variant); prints a table.
"""
import cProfile, gzip, json, os, pstats, subprocess, sys, tempfile, time
from fastai_dali.bench.traces import stream_split   # (reading the traces: the bench's traces page)

VARIANTS = {'synthetic': {}, 'loader defaults': {}, 'prefetch=3': dict(prefetch=3), 'prefetch=4': dict(prefetch=4), 'prefetch=6': dict(prefetch=6),
            'num_threads=6': dict(num_threads=6), 'num_threads=8': dict(num_threads=8),
            # DALI's dynamic executor (its default; the loader's before it took the classic one: `executor_pipeline`),
            # alone, on cudaMallocAsync, and with the fit on a side stream (torch's work off the legacy default stream)
            'dynamic executor': dict(_dynamic=True), 'dynamic executor + prefetch=3': dict(prefetch=3, _dynamic=True),
            'dynamic executor + DALI_USE_CUDA_MALLOC_ASYNC=1': dict(_dynamic=True, _env=dict(DALI_USE_CUDA_MALLOC_ASYNC='1')),
            'dynamic executor + fit on a side stream': dict(_dynamic=True, _stream=True),
            # more hardware work queues than CUDA's 8 (the decoder's 14 streams, DALI's, torch's share 8 by default; a
            # kernel whose stream shares the graph's queue waits for the whole graph: `loader_waits`); importing fastai_dali
            # sets 32 unless set (`set_work_queues`), so 'loader defaults' has 32 and the 8 is explicit
            'CUDA_DEVICE_MAX_CONNECTIONS=8': dict(_env=dict(CUDA_DEVICE_MAX_CONNECTIONS='8')),
            'CUDA_DEVICE_MAX_CONNECTIONS=32': dict(_env=dict(CUDA_DEVICE_MAX_CONNECTIONS='32')),
            'CUDA_DEVICE_MAX_CONNECTIONS=32 + prefetch=3': dict(prefetch=3, _env=dict(CUDA_DEVICE_MAX_CONNECTIONS='32')),
            # the decoder: its per-image colour conversion (`ycbcr_to_format_kernel_roi`, a host wait each on the decoder's
            # thread, each queued behind the graph's kernels) without the interpolated chroma the loader asks for (PIL's);
            # all of each batch on the CUDA decoder instead of the hardware one (the loader's 1.0), or DALI's default share
            'jpeg_fancy_upsampling=False': dict(_decoder=dict(jpeg_fancy_upsampling=False)),
            'hw_decoder_load=0': dict(hw_decoder_load=0.0), 'hw_decoder_load=0.65': dict(hw_decoder_load=0.65),
            # the host's wait for the loader off the launch's path: each batch fetched by a thread of its own, two ahead,
            # its copies on a side stream that the fit's stream waits for on the GPU (`fetch_ahead`)
            'fetch thread': dict(_thread=True)}
TRACED = ('loader defaults', 'dynamic executor', 'dynamic executor + DALI_USE_CUDA_MALLOC_ASYNC=1', 'CUDA_DEVICE_MAX_CONNECTIONS=32',
          'CUDA_DEVICE_MAX_CONNECTIONS=8', 'jpeg_fancy_upsampling=False', 'hw_decoder_load=0', 'fetch thread')   # (a torch.profiler trace of one more epoch)

def fetch_ahead(gen, depth=2):
    """A loader's batches from `gen` (a generator function of the loader), each fetched by a thread of its own up to
    `depth` ahead: the host's wait for DALI's outputs happens there, its copies on a side stream, and the consumer's
    stream waits for them on the GPU (an event), so a late batch delays the GPU by its own lateness, not by the host's
    path from the batch to the launch as well (a prototype: measured before the loader takes it)"""
    import queue, threading, torch
    from fastai.torch_core import apply
    def it(dl):
        q,stop = queue.Queue(maxsize=depth),threading.Event()
        side = torch.cuda.Stream() if torch.cuda.is_available() else None
        def work():
            try:
                with torch.cuda.stream(side):
                    for b in gen(dl):
                        ev = None
                        if side is not None: ev = torch.cuda.Event(); ev.record(side)
                        q.put(('batch', b, ev))
                        if stop.is_set(): return
                q.put(('end', None, None))
            except BaseException as e: q.put(('error', e, None))
        t = threading.Thread(target=work, daemon=True); t.start()
        try:
            while True:
                kind,b,ev = q.get()
                if kind == 'end': return
                if kind == 'error': raise b
                if ev is not None:
                    cur = torch.cuda.current_stream(); cur.wait_event(ev)
                    apply(lambda x: x.record_stream(cur) if isinstance(x, torch.Tensor) and x.is_cuda else None, b)   # (made on the side stream, read on this one)
                yield b
        finally:
            stop.set()
            while t.is_alive():   # (a consumer that stops early: the thread finishes the batch it holds, its place freed)
                try: q.get_nowait()
                except queue.Empty: t.join(0.001)
    return it

def one(out, arch, root, name):
    import torch
    from fastai.vision.all import Resize, Normalize, imagenet_stats, models, DataLoaders
    from fastai_dali.data import DaliDataLoaders
    from fastai_dali.graphs import StepGraphCallback
    from fastai_dali.training import DeviceLossCallback
    from fastai_dali.optimizer import ForeachAdam
    from fastai_dali.bench.training import bench_learner, train_timer, SyntheticDL
    import fastai_dali.feed, fastai_dali.loader
    dev = os.environ.get('FASTAI_DALI_TEST_DEVICE', 'cuda')   # (cpu: a dry run of this script, nothing graphed)
    kw = dict(item_tfms=Resize(224), batch_tfms=Normalize.from_stats(*imagenet_stats), bs=128, device=dev)
    v = {k:x for k,x in VARIANTS[name].items() if not k.startswith('_')}
    if VARIANTS[name].get('_dynamic'): fastai_dali.feed.executor_pipeline = lambda *a, **k: fastai_dali.feed.fastai_pipeline(*a, **k)
    if VARIANTS[name].get('_thread'): fastai_dali.loader.DaliDL.__iter__ = fetch_ahead(fastai_dali.loader.DaliDL.__iter__)
    if VARIANTS[name].get('_decoder'):   # (the pipeline looks its decoder up in `fn.decoders` as it builds the graph)
        from nvidia.dali import fn
        for op in ('image', 'image_slice', 'image_crop', 'image_random_crop'):
            setattr(fn.decoders, op, lambda *a, _f=getattr(fn.decoders, op), **k: _f(*a, **{**k, **VARIANTS[name]['_decoder']}))
    dls = DaliDataLoaders.from_folder(root, **kw, **v)
    cb,extra,c = StepGraphCallback(),{},dls.c
    if name == 'synthetic':
        sdl = SyntheticDL(bs=128, size=224, n_batches=len(dls.train), c=c, device=dev)
        dls,extra = DataLoaders(sdl, sdl),dict(opt_func=ForeachAdam)
    learn = bench_learner(dls, getattr(models, arch), c, fast_path=True, **extra)
    learn.add_cbs([cb] + ([DeviceLossCallback()] if name == 'synthetic' else []))
    t = train_timer(validate=False)
    fit = lambda: learn.fit(1, 1e-3, cbs=[t])
    if VARIANTS[name].get('_stream'):
        s,f0 = torch.cuda.Stream(),fit
        def fit():
            with torch.cuda.stream(s): f0()
    with learn.no_bar(), learn.no_logging():
        fit(); fit()   # (the warm-up: compiling, the capture; then a timed epoch)
        pr = cProfile.Profile(); pr.enable(); fit(); dev == 'cpu' or torch.cuda.synchronize(); pr.disable()
        st = pstats.Stats(pr).stats
        # (`fetch thread`: the fit's thread waits in its queue's `get`, whose time is in the lock it calls: cumulative)
        wait = sum(v[3] if k[2] == 'get' else v[2] for k,v in st.items() if k[2] == 'share_outputs' or (k[2] == 'get' and k[0].endswith('queue.py')))
        replay = sum(v[2] for k,v in st.items() if k[2] == 'replay' and 'graphs' in k[0])
        n = max(1, cb.counts['replayed'] + cb.counts['fastai'])   # (the training batches of the profiled epoch)
        r = dict(arch=arch, variant=name, img_s=[round(x) for x in t.runs], counts=dict(cb.counts),
                 batches=n, loader_wait_ms=round(1000*wait/n, 3),
                 replay_call_ms=round(1000*replay/max(1, cb.counts['replayed']), 3))
        if name in TRACED:
            from torch.profiler import profile, ProfilerActivity
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=bool(os.environ.get('TRACE_STACKS'))) as prof: fit()
            with tempfile.TemporaryDirectory() as d:
                prof.export_chrome_trace(f'{d}/t.json'); ev = json.load(open(f'{d}/t.json'))['traceEvents']
            with gzip.open(f'{out}/trace_step_graph_loader_{arch}_{TRACED.index(name)}.json.gz', 'wt') as g: json.dump({'traceEvents': ev}, g)
            r['trace'] = stream_split(ev, max(1, cb.counts['replayed'] + cb.counts['fastai']))
            r['trace_img_s'] = round(t.runs[-1])
    print(json.dumps(r), flush=True)

def main(out, arch='resnet18', root=os.path.join(tempfile.gettempdir(), 'bt/data_10000'), variants=None):
    from fastai_dali.samples import make_bench_dataset
    make_bench_dataset(root, 10000)
    fn = f'{out}/step_graph_loader.json'
    res = json.load(open(fn)) if os.path.exists(fn) else {}
    for name in (variants.split(',') if variants else VARIANTS):
        t = time.time()
        env = {**os.environ, **VARIANTS[name].get('_env', {})}
        p = subprocess.run([sys.executable, __file__, '--one', out, arch, root, name], capture_output=True, text=True, env=env)
        line = next((l for l in p.stdout.splitlines()[::-1] if l.startswith('{')), None)
        if line is None:
            err = '\n'.join(l for l in p.stderr.splitlines() if 'nvjpeg2k' not in l and 'nvtiff' not in l)[-1500:]
            res.setdefault('errors', {})[f'{arch}: {name}'] = err; print(f'{arch}: {name} FAILED (rc {p.returncode})\n{err}', flush=True)
        else:
            res.setdefault(arch, {})[name] = json.loads(line); print(f'{time.time()-t:.0f} s', line, flush=True)
        json.dump(res, open(fn, 'w'), indent=1)
    print(f"\n| {arch}, StepGraphCallback | img/s (the timed fits) | host waits for the loader, ms a batch | replay call, ms |\n|---|---:|---:|---:|")
    for name,r in res.get(arch, {}).items():
        print(f"| {name} | {' / '.join(f'{x:,}' for x in r['img_s'])} | {r['loader_wait_ms']} | {r['replay_call_ms']} |")

if __name__ == '__main__':
    if sys.argv[1] == '--one': one(*sys.argv[2:])
    elif sys.argv[1] == '--trace': print(json.dumps(stream_split(json.load(gzip.open(sys.argv[2]))['traceEvents'], int(sys.argv[3])), indent=1))
    else: main(*sys.argv[1:])

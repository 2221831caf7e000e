"""The loader beside `StepGraphCallback`: where a graphed `learn.fit` on `DaliDataLoaders` loses to the same fit on
synthetic batches (a GPU).

Each variant in a process of its own (resnet18 by default; bf16, channels_last, bs 128, 224 px, 10,000 JPEGs of
`make_bench_dataset`, the fast path + `StepGraphCallback`): a warm-up fit of one epoch, a timed one, then one epoch under
cProfile, whose DALI `share_outputs` time is the host waiting for the loader's next batch. Variants: synthetic batches
(no loader), the loader's defaults, `prefetch` 3, 4 and 6, `num_threads` 6 and 8, DALI's dynamic executor,
`CUDA_DEVICE_MAX_CONNECTIONS` 8 (CUDA's default) and 32 (fastai_dali's since `set_work_queues`), the decoder without
interpolated chroma (`jpeg_fancy_upsampling=False`), `hw_decoder_load` 0 and 0.65, the batches fetched by a thread
of their own (`fetch_ahead`). For the variants in
`TRACED`, a torch.profiler trace of one epoch, its kernels split by CUDA stream (the graph's, DALI's: each stream's
kernels, their union, how much of them overlap), the loader's waits (`loader_waits`) and what the graph's stream does
between replays (`between_replays`), per batch; with Python stacks where `TRACE_STACKS=1`. `python scripts/step_graph_loader.py --trace FILE BATCHES` reads a saved trace again.

    python scripts/step_graph_loader.py OUT [ARCH] [ROOT] [VARIANTS]   (VARIANTS: comma-separated names, default all; none has a comma)

Writes OUT/step_graph_loader.json and OUT/trace_step_graph_loader_ARCH_K.json.gz (K: the traced variant); prints a table.
"""
import bisect, cProfile, collections, gzip, json, os, pstats, statistics, subprocess, sys, tempfile, time

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

def stream_split(events, batches):
    "Kernels of a chrome trace's `events` per CUDA stream: ms a batch on each, their union (the GPU busy), the overlap"
    ks = [(e['ts'], e['ts'] + e['dur'], e.get('args', {}).get('stream'), e['name']) for e in events
          if e.get('cat') == 'kernel' and e.get('ph') == 'X']
    per,names = collections.Counter(),collections.defaultdict(collections.Counter)
    for a,b,s,n in ks: per[s] += b - a; names[s][n[:60]] += b - a
    busy = sum(b - a for a,b in _union((a, b) for a,b,_,_ in ks))   # (the union of the kernels' intervals)
    span = (max(b for _,b,_,_ in ks) - min(a for a,_,_,_ in ks)) if ks else 0.
    ms = lambda us: round(us/1000/batches, 3)
    syncs = [e for e in events if e.get('cat') == 'cuda_runtime' and e.get('name') == 'cudaDeviceSynchronize']
    return dict(device_syncs=round(len(syncs)/batches, 2), device_sync_ms=ms(sum(e['dur'] for e in syncs)),
                per_stream={str(s): dict(ms=ms(v), top=[k for k,_ in names[s].most_common(3)]) for s,v in per.most_common()},
                kernels_ms=ms(sum(per.values())), busy_ms=ms(busy), overlap_ms=ms(sum(per.values()) - busy), span_ms=ms(span),
                **loader_waits(events, batches, max(per, key=per.get) if per else None), between_replays=between_replays(events, batches))

def loader_waits(events, batches, graph_stream, late_us=1000):
    "How the loader's GPU work waits for the graph: its kernels' launch-to-start delay, its threads' event waits, a batch"
    launch = {e['args'].get('correlation'): e for e in events if e.get('cat') == 'cuda_runtime' and 'args' in e}
    g = sorted((e['ts'], e['ts'] + e['dur']) for e in events if e.get('cat') == 'kernel' and e.get('args', {}).get('stream') == graph_stream)
    run_ends = [a[1] for a,b in zip(g, g[1:]) if b[0] - a[1] > 300]   # (the graph stream's last kernel before it idles)
    fit_threads = {e['tid'] for e in events if e.get('name') == 'cudaGraphLaunch'}
    waits = [(k['ts'] - launch[k['args']['correlation']]['ts'], k['ts'], k['name']) for k in events if k.get('cat') == 'kernel'
             and k.get('args', {}).get('stream') != graph_stream and k['args'].get('correlation') in launch]
    by_name = collections.Counter(n[:60] for w,_,n in waits if w > late_us)
    late = [(w,ts) for w,ts,_ in waits if w > late_us]
    after_run = sum(any(0 <= ts - r < 500 for r in run_ends) for _,ts in late)   # (started as the graph's run ended)
    ev_sync = [e['dur'] for e in events if e.get('cat') == 'cuda_runtime' and e.get('name') == 'cudaEventSynchronize'
               and e['tid'] not in fit_threads]
    ms = lambda us: round(us/1000/batches, 3)
    return dict(loader_kernels=round(len(waits)/batches, 1), loader_kernels_late=round(len(late)/batches, 2),
                loader_kernels_late_wait_ms=round(sum(w for w,_ in late)/1000/max(1, len(late)), 3),
                loader_kernels_late_after_graph=round(after_run/max(1, len(late)), 2),
                loader_kernels_late_by_name={n: round(c/batches, 2) for n,c in by_name.most_common(4)},
                loader_event_syncs=round(len(ev_sync)/batches, 1), loader_event_sync_ms=ms(sum(ev_sync)))

def between_replays(events, batches, stall_us=1000):
    """The graph's stream between one replay and the next, a batch (ms): the gap from one replay's last kernel to the
    next one's first; the part of it after the batch had reached the host (DALI's `share_outputs` returned, or the
    `fetch thread`'s queue; with no Python stacks the fit thread's last `cudaEventSynchronize` before the launch), i.e.
    the host's own path from the loader's outputs to the launch; the stream's own work in the gaps (the batch's copies);
    the host's wait for the batch; the host's time from the batch to the launch; the median delay from a launch to its
    first kernel (the GPU's backlog: ~0 where the host is late); the stalls (gaps over `stall_us`); and, with Python
    stacks, Python calls a batch on the fit's thread and the top-level calls between the batch and the launch"""
    launch = sorted((e for e in events if e.get('cat') == 'cuda_runtime' and e.get('name') == 'cudaGraphLaunch'), key=lambda e: e['ts'])
    if len(launch) < 2: return {}
    tid,corr = launch[0]['tid'],{e['args']['correlation']: i for i,e in enumerate(launch)}
    span = [[None, None] for _ in launch]
    for e in events:
        i = corr.get(e.get('args', {}).get('correlation')) if e.get('cat') in ('kernel', 'gpu_memcpy', 'gpu_memset') else None
        if i is not None:
            a,b = span[i]; span[i] = [e['ts'] if a is None else min(a, e['ts']), e['ts'] + e['dur'] if b is None else max(b, e['ts'] + e['dur'])]
    if sum(a is not None for a,_ in span) < 2: return {}   # (no kernel tied to the launches: nothing to read)
    host = sorted((e for e in events if e.get('tid') == tid and e.get('cat') in ('python_function', 'cpu_op', 'cuda_runtime')), key=lambda e: e['ts'])
    stacks = any(e['cat'] == 'python_function' for e in host)
    ready = [e for e in host if ('share_outputs' in e['name'] if stacks else e['name'] == 'cudaEventSynchronize')]
    if stacks and not ready: ready = [e for e in host if 'queue.py' in e['name'] and '): get' in e['name']]   # (`fetch thread`)
    starts,hts = [e['ts'] for e in ready],[e['ts'] for e in host]
    tot,top,n,stalls,windows = collections.Counter(),collections.Counter(),0,[],[]
    for i in range(1, len(launch)):
        if None in span[i] or None in span[i-1]: continue
        j = bisect.bisect_right(starts, launch[i]['ts']) - 1   # (-1: no wait for the loader on the fit's thread)
        l,s,e0 = launch[i]['ts'],span[i][0],span[i-1][1]
        w = ready[j]['dur'] if j >= 0 else 0.
        if s - e0 > stall_us: stalls.append((s - e0, w, s - l)); windows.append((e0, s))
        tot['gap'] += max(0, s - e0); n += 1
        if j < 0: continue
        r = ready[j]['ts'] + ready[j]['dur']
        tot['gap_after_batch_on_host'] += max(0, s - max(r, e0))
        tot['host_wait'] += w; tot['host_batch_to_launch'] += l + launch[i]['dur'] - r
        if stacks:
            end = -1
            for e in host[bisect.bisect_left(hts, r):]:
                if e['ts'] > l: break
                if e['ts'] >= end and e['ts'] + e.get('dur', 0) <= l + launch[i]['dur']: top[e['name'][:80]] += e['dur']; end = e['ts'] + e['dur']
    ms = lambda us: round(us/1000/max(1, n), 3)
    # the graph's stream's own work between replays (the batch's copies, the smoothed loss, the numbers' copy)
    gs = next((e['args'].get('stream') for e in events if e.get('cat') == 'kernel' and e.get('args', {}).get('correlation') in corr), None)
    ends = sorted(b for _,b in span if b is not None); sts = sorted(a for a,_ in span if a is not None)
    def between(t):   # (after a replay's end, before the next one's start)
        done = bisect.bisect_right(ends, t); return 0 < done < len(sts) and done == bisect.bisect_right(sts, t)
    tot['graph_stream_work_between'] = sum(e['dur'] for e in events if e.get('cat') in ('kernel', 'gpu_memcpy', 'gpu_memset')
                                          and e.get('args', {}).get('stream') == gs and e['args'].get('correlation') not in corr and between(e['ts']))
    r = {f'{k}_ms': ms(v) for k,v in tot.items()}
    if not ready: r.update(gap_after_batch_on_host_ms=None, host_wait_ms=None, host_batch_to_launch_ms=None)   # (not seen on the fit's thread)
    r['launch_to_first_kernel_median_ms'] = round(statistics.median(span[i][0] - launch[i]['ts'] for i in range(len(launch)) if span[i][0] is not None)/1000, 3)
    r['graph_launch_call_ms'] = round(statistics.median(e['dur'] for e in launch)/1000, 3)
    # the gaps over `stall_us`: how many, their share of all the gaps, and what
    # the host and the GPU did meanwhile (the host's wait for the loader; the delay from the launch to the first kernel)
    mean = lambda xs: round(statistics.mean(xs)/1000, 3) if xs else 0.
    r['stalls'] = dict(batches=len(stalls), of=n, share_of_gaps=round(sum(x[0] for x in stalls)/max(1, tot['gap']), 2),
                       gap_ms=mean([x[0] for x in stalls]), host_wait_ms=mean([x[1] for x in stalls]), launch_to_first_kernel_ms=mean([x[2] for x in stalls]),
                       **in_stalls(events, windows, (launch[0]['ts'], max(b for _,b in span if b is not None)), gs, tid))
    if stacks:
        r['python_calls_a_batch'] = round(sum(e['cat'] == 'python_function' for e in host if launch[0]['ts'] <= e['ts'] < launch[-1]['ts'])/(len(launch) - 1))
        r['host_batch_to_launch_top'] = {k: ms(v) for k,v in top.most_common(8)}
    return r

def _union(intervals):
    "The union of `intervals` ((start, end) pairs): sorted, disjoint [start, end] pairs"
    merged = []
    for a,b in sorted(intervals):
        if merged and a <= merged[-1][1]: merged[-1][1] = max(merged[-1][1], b)
        else: merged.append([a, b])
    return merged

def _covered(merged, windows):
    "How much of `windows` (disjoint (start, end) pairs) the disjoint intervals `merged` cover"
    return sum(max(0, min(b, wb) - max(a, wa)) for a,b in merged for wa,wb in windows)

def in_stalls(events, windows, span, graph_stream, fit_tid):
    """What the rest of the GPU and the loader's busiest thread do in the stalls' `windows`, against the rest of `span`
    (shares of time): the other streams' work (their union), the thread launching most kernels outside the fit's
    thread (DALI's decoder) in CUDA calls; and that thread's pace, the median time from one of its host-to-device
    copies to the next (one an image on the hardware decoder's path)"""
    if not windows: return {}
    w = sum(b - a for a,b in windows); rest = max(1., span[1] - span[0] - w)
    gpu = _union((e['ts'], e['ts'] + e['dur']) for e in events if e.get('cat') in ('kernel', 'gpu_memcpy', 'gpu_memset')
                 and e.get('args', {}).get('stream') != graph_stream and span[0] <= e['ts'] <= span[1])
    tids = collections.Counter(e['tid'] for e in events if e.get('cat') == 'cuda_runtime' and e.get('name') == 'cudaLaunchKernel' and e['tid'] != fit_tid)
    r = dict(other_streams_busy=round(_covered(gpu, windows)/w, 2), other_streams_busy_elsewhere=round((_covered(gpu, [span]) - _covered(gpu, windows))/rest, 2))
    if tids:
        t = tids.most_common(1)[0][0]
        calls = sorted((e['ts'], e['ts'] + e['dur']) for e in events if e.get('cat') == 'cuda_runtime' and e['tid'] == t and span[0] <= e['ts'] <= span[1])
        inside = sum(max(0, min(b, wb) - max(a, wa)) for a,b in calls for wa,wb in windows)
        mc = sorted(e['ts'] for e in events if e.get('cat') == 'cuda_runtime' and e['tid'] == t and e.get('name') == 'cudaMemcpyAsync' and span[0] <= e['ts'] <= span[1])
        r.update(loader_thread_in_cuda_calls=round(inside/w, 2), loader_thread_in_cuda_calls_elsewhere=round((sum(b - a for a,b in calls) - inside)/rest, 2),
                 loader_thread_copy_to_copy_median_us=round(statistics.median(b - a for a,b in zip(mc, mc[1:])), 1) if len(mc) > 1 else None)
    return r

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

def main(out, arch='resnet18', root='/tmp/bt/data_10000', variants=None):
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

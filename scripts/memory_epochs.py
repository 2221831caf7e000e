"""Memory over many epochs of `DaliDataLoaders` training: is it bounded, and what grows?

Trains a tiny model for `--epochs` epochs (one `Learner.fit`) on a small generated JPEG folder and records after every
epoch (after `gc.collect()`): RSS, glibc malloc's view of the heap (`mallinfo2`: bytes in use vs free inside its
arenas, mmapped bytes, the number of arenas), the Python heap (tracemalloc), live objects by type (gc), live DALI
pipelines (`fastai_dali.lifetime._live_pipes`), Python threads, native threads, open fds and the worker processes' RSS.
`--trim` calls `malloc_trim(0)` before every reading (and records RSS before and after): what `malloc_trim` gives back
was free memory that glibc kept, not live data. At the end: the growth per epoch (least squares) over the first and
the second half of the epochs after `--warmup`, and the Python allocations / object types that grew most.

Scenarios: `files` (DALI's file reader), `bytes` (a `get_x` returning the encoded bytes, called in this process),
`workers` (the same in `--py-workers` DALI worker processes). Usage (CPU backend, writes one JSON per scenario):

    python scripts/memory_epochs.py --scenarios files,bytes,workers --epochs 200 --out /tmp/mem [--trim] [--pre-pipes 0]

`--pre-pipes N` first builds, iterates and drops N loaders (train and valid pipelines of batch size `--pre-bs`, each
from another thread), as earlier tests in a pytest session do, to show how glibc's state before the run (its dynamic
mmap threshold, the free memory it keeps) changes the RSS curve while the memory the program holds does not change.
"""
import argparse, ctypes, collections, gc, json, os, re, sys, threading, time, tracemalloc, warnings, tempfile
from pathlib import Path

warnings.filterwarnings('ignore')
import numpy as np, torch
from torch import nn
from fastai.vision.all import (DataBlock, ImageBlock, CategoryBlock, GrandparentSplitter, Resize, get_image_files,
                               parent_label, Learner, Callback, CrossEntropyLossFlat)
from fastai_dali.all import DaliDataLoaders   # (with its patches, as a user imports it)
from fastai_dali.samples import make_image_folder
import fastai_dali.lifetime as P

_libc = ctypes.CDLL('libc.so.6')

class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                'arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost'.split()]

def mallinfo():
    "glibc's heap counters, in KB: `inuse` = allocated by the program, `free` = free chunks glibc keeps in its arenas"
    try: f = _libc.mallinfo2
    except AttributeError: return {}
    f.restype = _MallInfo2
    m = f()
    return dict(arena=m.arena//1024, mmap=m.hblkhd//1024, inuse=m.uordblks//1024, free=m.fordblks//1024,
                top_pad=m.keepcost//1024)

def n_arenas():
    "Number of glibc malloc arenas (main + one per set of threads that contended), from malloc_info's XML"
    buf,size = ctypes.c_char_p(),ctypes.c_size_t()
    fopen = _libc.open_memstream; fopen.restype = ctypes.c_void_p
    fp = fopen(ctypes.byref(buf), ctypes.byref(size))
    _libc.malloc_info(0, ctypes.c_void_p(fp)); _libc.fclose(ctypes.c_void_p(fp))
    xml = ctypes.string_at(buf, size.value).decode(); _libc.free(buf)
    return len(re.findall(r'<heap nr=', xml))

def status(pid='self'):
    "VmRSS and RssAnon (KB) of a process"
    d = {}
    try:
        for l in open(f'/proc/{pid}/status'):
            k,_,v = l.partition(':')
            if k in ('VmRSS', 'RssAnon'): d[k] = int(v.split()[0])
    except OSError: pass
    return d

def children_rss():
    "Total RSS (KB) and count of this process's child processes (DALI's Python workers)"
    me,tot,n = str(os.getpid()),0,0
    for p in os.listdir('/proc'):
        if not p.isdigit(): continue
        try: ppid = next(l for l in open(f'/proc/{p}/status') if l.startswith('PPid:')).split()[1]
        except (OSError, StopIteration): continue
        if ppid == me: tot += status(p).get('VmRSS', 0); n += 1
    return tot, n

def type_counts():
    "Live gc-tracked objects by type (module.qualname)"
    return collections.Counter(f'{type(o).__module__}.{type(o).__qualname__}' for o in gc.get_objects())

DALI_TYPES = ('nvidia.dali.plugin.pytorch.DALIGenericIterator', 'nvidia.dali.pipeline.Pipeline', 'fastai_dali.loader.EpochSource',
              'fastai_dali.loader.EpochFlag', 'multiprocessing.shared_memory.SharedMemory', 'fastai_dali.loader._Live',
              'fastai_dali.loader.DaliDL', 'builtins.generator')

def read_bytes(f): return Path(f).read_bytes()

def make_loaders(path, scenario, bs, py_workers, size):
    kw = dict(item_tfms=Resize(size), bs=bs, device='cpu', num_threads=1)
    if scenario == 'files': return DaliDataLoaders.from_folder(path, **kw)
    blk = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files, get_x=read_bytes, get_y=parent_label,
                    splitter=GrandparentSplitter(), item_tfms=kw.pop('item_tfms'))
    return blk.dali_dataloaders(path, py_workers=py_workers if scenario == 'workers' else 0, **kw)

def pre_pipes(path, n, size, bs):
    """Build, iterate and drop `n` pairs of pipelines (train, valid) of batch size `bs`, each from a fresh thread, as
    earlier tests in one pytest session do (e.g. tests/test_exactly_once.py: up to 4 shards x 2 loaders, bs up to 64)"""
    for i in range(n):
        def _run():
            dls = DaliDataLoaders.from_folder(path, item_tfms=Resize(size + 8*(i % 5)), bs=bs, device='cpu', num_threads=1 + i % 2)
            for _ in dls.train: pass
            for _ in dls.valid: pass
        t = threading.Thread(target=_run); t.start(); t.join()
    gc.collect()

class Probe(Callback):
    "Records the process's memory and resources after every epoch"
    order = 100
    def __init__(self, trim=False, tm=True, every=10):
        self.trim,self.tm,self.every,self.rows,self.types = trim,tm,every,[],{}
    def after_epoch(self):
        gc.collect()
        ep = len(self.rows)
        r = dict(epoch=ep+1, t=time.monotonic())
        r.update({k.lower(): v for k,v in status().items()})
        if self.trim:
            _libc.malloc_trim(0)
            r.update({k.lower()+'_trimmed': v for k,v in status().items()})
        r.update(mallinfo())
        r['arenas'] = n_arenas()
        if self.tm: r['py_heap'] = tracemalloc.get_traced_memory()[0]//1024
        if (ep+1) % self.every == 0 or ep+1 in self.snap_at or ep < 3:  # a walk over every object: not every epoch
            tc = type_counts()
            r['gc_objects'] = sum(tc.values())
            r.update({f'n_{k.rsplit(".", 1)[1]}': tc.get(k, 0) for k in DALI_TYPES})
        r['live_pipes'] = len(P._live_pipes)
        r['threads'],r['tasks'],r['fds'] = threading.active_count(),len(os.listdir('/proc/self/task')),len(os.listdir('/proc/self/fd'))
        r['children_rss'],r['children'] = children_rss()
        self.rows.append(r)
        if ep+1 in self.snap_at: self.types[ep+1] = tc; self.snaps[ep+1] = tracemalloc.take_snapshot() if self.tm else None
        if (ep+1) % 10 == 0 or ep < 3:
            print(f"  epoch {ep+1}: rss {r.get('vmrss')} KB, malloc in use {r.get('inuse')} KB free {r.get('free')} KB, "
                  f"arenas {r['arenas']}, py heap {r.get('py_heap')} KB, gc objects {r.get('gc_objects')}, "
                  f"pipes {r['live_pipes']}, tasks {r['tasks']}, fds {r['fds']}", flush=True)

def slope(xs, ys):
    "Least-squares growth per epoch"
    if len(xs) < 2: return 0.
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])

def summarize(rows, warmup):
    rows = [r for r in rows if r['epoch'] > warmup]
    h = len(rows)//2
    res = {}
    for k in ('vmrss', 'vmrss_trimmed', 'rssanon', 'inuse', 'free', 'arena', 'mmap', 'py_heap', 'gc_objects', 'children_rss'):
        if k not in rows[0]: continue
        sel = [r for r in rows if k in r]
        xs,ys = [r['epoch'] for r in sel],[r[k] for r in sel]
        h = len(sel)//2
        res[k] = dict(first=ys[0], last=ys[-1], max=max(ys), total=ys[-1]-ys[0],
                      per_epoch_1st_half=round(slope(xs[:h], ys[:h]), 2), per_epoch_2nd_half=round(slope(xs[h:], ys[h:]), 2))
    for k in ('live_pipes', 'threads', 'tasks', 'fds', 'arenas', 'children', *[f'n_{t.rsplit(".", 1)[1]}' for t in DALI_TYPES]):
        res[k] = sorted({r[k] for r in rows if k in r})
    return res

def run(scenario, a, path):
    print(f"== {scenario}: {a.epochs} epochs", flush=True)
    if a.tracemalloc: tracemalloc.start(a.frames)
    dls = make_loaders(path, scenario, a.bs, a.py_workers, a.size)
    model = nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(48, len(dls.vocab)))
    probe = Probe(a.trim, a.tracemalloc, a.every)
    probe.snap_at,probe.snaps = {a.warmup, a.epochs},{}
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), cbs=probe)
    t0 = time.monotonic()
    with learn.no_bar(), learn.no_logging(): learn.fit(a.epochs, 1e-3)
    res = dict(scenario=scenario, epochs=a.epochs, seconds=round(time.monotonic()-t0, 1), args=vars(a),
               n_train=len(dls.train_ds), n_valid=len(dls.valid_ds), builds=(dls.train.n_builds, dls.valid.n_builds),
               summary=summarize(probe.rows, a.warmup), rows=probe.rows)
    t0,t1 = probe.types[a.warmup],probe.types[a.epochs]
    res['gc_type_growth'] = sorted(((k, t1[k]-t0.get(k, 0)) for k in t1 if t1[k] != t0.get(k, 0)), key=lambda o: -abs(o[1]))[:25]
    if a.tracemalloc:
        st = probe.snaps[a.epochs].compare_to(probe.snaps[a.warmup], 'traceback')
        res['tracemalloc_growth'] = [dict(size_kb=round(s.size_diff/1024, 1), count=s.count_diff,
                                          where=[f'{f.filename}:{f.lineno}' for f in s.traceback][-a.frames:])
                                     for s in st[:12]]
        tracemalloc.stop()
    r0 = status()['VmRSS']; _libc.malloc_trim(0); r1 = status()['VmRSS']
    res['final_trim'] = dict(rss_before=r0, rss_after=r1, returned=r0-r1)
    del learn, dls, probe; gc.collect()
    return res

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--scenarios', default='files,bytes,workers')
    p.add_argument('--epochs', type=int, default=200)
    p.add_argument('--warmup', type=int, default=5, help="epochs before the reference reading")
    p.add_argument('--n-train', type=int, default=12, help="images per class (4 classes), train")
    p.add_argument('--n-valid', type=int, default=4, help="images per class, valid")
    p.add_argument('--bs', type=int, default=8); p.add_argument('--size', type=int, default=64)
    p.add_argument('--py-workers', type=int, default=2)
    p.add_argument('--trim', action='store_true', help="malloc_trim(0) before every reading")
    p.add_argument('--pre-pipes', type=int, default=0, help="loaders (train + valid pipelines) built, run and dropped before the run")
    p.add_argument('--pre-bs', type=int, default=64, help="their batch size")
    p.add_argument('--no-tracemalloc', dest='tracemalloc', action='store_false')
    p.add_argument('--frames', type=int, default=6, help="tracemalloc frames kept per allocation")
    p.add_argument('--every', type=int, default=10, help="count objects by type every this many epochs")
    p.add_argument('--out', default=os.path.join(tempfile.gettempdir(), 'memory_epochs'))
    a = p.parse_args()
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    path = make_image_folder(out/'data', n_train=a.n_train, n_valid=a.n_valid)
    if a.pre_pipes:
        t0 = time.monotonic(); pre_pipes(path, a.pre_pipes, a.size, a.pre_bs)
        print(f"{a.pre_pipes} loaders built, run and dropped in {time.monotonic()-t0:.0f} s; rss {status()['VmRSS']} KB, "
              f"arenas {n_arenas()}, malloc {mallinfo()}", flush=True)
    tag = ('_trim' if a.trim else '') + (f'_pre{a.pre_pipes}' if a.pre_pipes else '')
    for s in a.scenarios.split(','):
        res = run(s, a, path)
        fn = out/f'memory_{s}{tag}.json'
        fn.write_text(json.dumps(res, indent=1))
        print(json.dumps({k: v for k,v in res.items() if k not in ('rows', 'args')}, indent=1), flush=True)
        print(f"-> {fn}", flush=True)

if __name__ == '__main__': main()

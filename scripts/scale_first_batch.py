"""Time to the first training batch and peak host memory of `ImageDataLoaders.from_folder` and
`DaliDataLoaders.from_folder` on an ImageNet-shaped folder of many small JPEGs, each loader in a fresh process.

    python scripts/scale_first_batch.py [--n 200000] [--classes 1000] [--root /tmp/scale_200000] [--device cpu]
        [--workers N] [--bs 256] [--repeats 1] [--trace DIR] [--shards N] [--mixed]

`--shards N`: also write the folder as WebDataset shards of N samples (`write_shards`, timed, in the machine's processes,
into ROOT_shards, index files removed) and add the rows `DaliDataLoaders.from_shards`, cold (it writes each shard's index
beside it) then warm (the next open, in a new process, reads them).
`--mixed`: also the row of a `DataBlock` whose `get_x` gives each file's bytes (`read_file_bytes`; DALI's Python worker
processes call it), labelled and split as `from_folder` is (`parent_label`, `GrandparentSplitter`), through
`dali_dataloaders`.

`--trace DIR`: each loader's process also writes `DIR/<loader>_profile.txt` (cProfile of the build and the first batch,
by cumulative then own time: its times are the profiler's, slower) and `DIR/<loader>_rss.txt` (the process's RSS every
5 ms, the highest at each line its main thread was on, in the order reached: where the memory comes from).

The folder (`train/` and `valid/`, one folder a class, 64 x 48 px JPEGs made with PIL from crops of scikit-image's
astronaut, ~1 validation image for 26 training ones) is written once, in parallel, and reused. Each row runs
`python scripts/scale_first_batch.py --one KIND ...` in a new process: imports (not counted), the loaders' build, the
first training batch; peak RSS of that process (and of its children: fastai's workers). Ratios are to
ImageDataLoaders in the same run. The bench's `scale` section is to replace this script.
"""
import argparse, io, json, os, shutil, subprocess, sys, time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def _write_class(job):
    root, c, n_train, n_valid, variants = job
    for split, m in (('train', n_train), ('valid', n_valid)):
        d = Path(root)/split/f'n{c:08d}'
        d.mkdir(parents=True, exist_ok=True)
        for i in range(m): (d/f'n{c:08d}_{i}.JPEG').write_bytes(variants[(c*7 + i) % len(variants)])


def make_scale_folder(root, n=200_000, classes=1000, procs=None):
    "`root/{train,valid}/<class>/*.JPEG`: `n` training JPEGs (64 x 48) in `classes` folders, and about n/26 validation ones; reused if there"
    import numpy as np, skimage.data
    from PIL import Image
    root = Path(root)
    if (root/'done').exists(): return root
    photo, rng = skimage.data.astronaut(), np.random.default_rng(0)
    variants = []
    for _ in range(64):
        y, x = rng.integers(0, photo.shape[0]-48), rng.integers(0, photo.shape[1]-64)
        b = io.BytesIO(); Image.fromarray(photo[y:y+48, x:x+64]).save(b, 'JPEG', quality=90); variants.append(b.getvalue())
    per = n//classes
    jobs = [(str(root), c, per, max(1, per//26), variants) for c in range(classes)]
    with ProcessPoolExecutor(procs or os.cpu_count()) as ex: list(ex.map(_write_class, jobs, chunksize=8))
    (root/'done').touch()
    return root


class _RssByLine:
    "The process's RSS every 5 ms in a thread, with the line the main thread is on: the highest RSS at each line, in order"
    def __init__(self):
        import threading
        self.main,self.rows,self.stop = threading.main_thread().ident,{},False
        threading.Thread(target=self._watch, daemon=True).start()
    def _watch(self):
        import traceback
        while not self.stop:
            with open('/proc/self/statm') as f: mb = int(f.read().split()[1])*os.sysconf('SC_PAGE_SIZE')/2**20
            fr = sys._current_frames().get(self.main)
            if fr is not None:
                st = traceback.extract_stack(fr)[-3:]
                k = ' < '.join(f'{os.path.basename(f.filename)}:{f.lineno} {f.name}' for f in st[::-1])
                self.rows[k] = max(self.rows.get(k, 0), mb)
            time.sleep(0.005)
    def write(self, fn):
        self.stop = True
        with open(fn, 'w') as f: f.writelines(f'{mb:8.0f} MB  {k}\n' for k,mb in self.rows.items())


def read_file_bytes(f):
    "`get_x` of the mixed row: the file's bytes (module level: DALI's worker processes import it)"
    return Path(f).read_bytes()


def one(kind, root, device, workers, bs, trace=None):
    "Build `kind`'s loaders on `root`, take the first training batch; print one JSON line (`trace`: a folder for the profile and RSS trace)"
    import resource, cProfile, pstats
    from fastai.vision.all import ImageDataLoaders, Resize, Normalize, imagenet_stats
    from fastai_dali.data import DaliDataLoaders
    import fastai_dali.shards  # (DaliDataLoaders.from_shards)
    kw = dict(valid='valid', item_tfms=Resize(32), batch_tfms=Normalize.from_stats(*imagenet_stats), bs=bs)
    if trace: rss,prof = _RssByLine(),cProfile.Profile(); prof.enable()
    t0 = time.perf_counter()
    if kind == 'ImageDataLoaders': dls = ImageDataLoaders.from_folder(root, num_workers=workers, device=device, **kw)
    elif kind.startswith('from_shards'):
        sh = Path(f'{root}_shards')
        dls = DaliDataLoaders.from_shards(sh/'train', sh/'valid', device=device, **{k:v for k,v in kw.items() if k != 'valid'})
    elif kind == 'mixed':
        from fastai.vision.all import DataBlock, ImageBlock, CategoryBlock, get_image_files, parent_label, GrandparentSplitter
        dblock = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files, get_x=read_file_bytes, get_y=parent_label,
                           splitter=GrandparentSplitter(valid_name='valid'), item_tfms=kw['item_tfms'], batch_tfms=kw['batch_tfms'])
        dls = dblock.dali_dataloaders(root, bs=bs, device=device)
    else: dls = DaliDataLoaders.from_folder(root, device=device, **kw)
    t1 = time.perf_counter()
    x, y = next(iter(dls.train))
    t2 = time.perf_counter()
    if trace:
        prof.disable(); os.makedirs(trace, exist_ok=True); rss.write(os.path.join(trace, f"{kind.replace(' ', '_')}_rss.txt"))
        with open(os.path.join(trace, f"{kind.replace(' ', '_')}_profile.txt"), 'w') as f:
            st = pstats.Stats(prof, stream=f); st.sort_stats('cumtime').print_stats(60); st.sort_stats('tottime').print_stats(30)
    mb = lambda who: resource.getrusage(who).ru_maxrss/1024
    print(json.dumps(dict(kind=kind, build=t1-t0, first_batch=t2-t1, total=t2-t0, peak_mb=mb(resource.RUSAGE_SELF),
                          children_mb=mb(resource.RUSAGE_CHILDREN), items=[len(dls.train_ds), len(dls.valid_ds)],
                          vocab=len(dls.vocab))), flush=True)
    import multiprocessing
    for c in multiprocessing.active_children(): c.kill()  # DALI's Python workers (from_shards): os._exit leaves them running
    os._exit(0)  # (the loaders' teardown is not timed)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--n', type=int, default=200_000); p.add_argument('--classes', type=int, default=1000)
    p.add_argument('--root'); p.add_argument('--device', default='cpu'); p.add_argument('--workers', type=int, default=os.cpu_count())
    p.add_argument('--bs', type=int, default=256); p.add_argument('--repeats', type=int, default=1); p.add_argument('--one')
    p.add_argument('--trace', help='a folder for each loader\'s profile and RSS trace (the times are then the profiler\'s)')
    p.add_argument('--shards', type=int, help='samples a shard: add the from_shards rows (shards written once, timed)')
    p.add_argument('--mixed', action='store_true', help="add the row of a get_x giving each file's bytes")
    a = p.parse_args()
    root = a.root or f'/tmp/scale_{a.n}'
    if a.one: return one(a.one, root, a.device, a.workers, a.bs, a.trace)
    t = time.perf_counter(); make_scale_folder(root, a.n, a.classes); print(f'folder {root}: {time.perf_counter()-t:.1f} s')
    kinds = ['ImageDataLoaders', 'DaliDataLoaders'] + (['mixed'] if a.mixed else [])
    if a.shards:
        from fastai_dali.shards import write_shards
        sh = Path(f'{root}_shards')
        if not (sh/f'done_{a.shards}').exists():   # (written once for this many samples a shard)
            if sh.exists(): shutil.rmtree(sh)
            t = time.perf_counter(); write_shards(root, sh, per_shard=a.shards, progress=False)
            print(f'write_shards {sh} ({a.shards} a shard, {os.cpu_count()} processes): {time.perf_counter()-t:.1f} s'); (sh/f'done_{a.shards}').touch()
        kinds += ['from_shards (indexing)', 'from_shards (indexed)']
    rows = []
    for r in range(a.repeats):
        for kind in kinds:
            if kind == 'from_shards (indexing)':   # (each repeat indexes them again)
                for f in Path(f'{root}_shards').glob('*/*.idx*'): f.unlink()
            out = subprocess.run([sys.executable, __file__, '--one', kind, '--root', root, '--device', a.device,
                                  '--workers', str(a.workers), '--bs', str(a.bs)] + (['--trace', a.trace] if a.trace else []),
                                 capture_output=True, text=True)
            line = next((l for l in out.stdout.splitlines()[::-1] if l.startswith('{')), None)
            if line is None: sys.exit(f'{kind} failed:\n{out.stderr[-3000:]}')
            rows.append(json.loads(line)); print(line)
    base = [o for o in rows if o['kind'] == 'ImageDataLoaders']
    print(f"\n| loader | build s | first batch s | to first batch s | peak MB | ratio (time, memory) |\n|---|---:|---:|---:|---:|---:|")
    for o in rows:
        b = base[rows.index(o)//len(kinds)]
        print(f"| {o['kind']} | {o['build']:.1f} | {o['first_batch']:.1f} | {o['total']:.1f} | {o['peak_mb']:,.0f} | "
              f"{o['total']/b['total']:.2f}, {o['peak_mb']/b['peak_mb']:.2f} |")


if __name__ == '__main__': main()

"""Where points and boxes cost a loader its time, on a GPU, for the `targets` bench's `DataBlock`s
(`fastai_dali.bench.target_blocks`): DALI's side alone (the pipeline's batches, `Feed.epoch`) against the whole loader
(fastai's batches, the targets moved on the device), in rounds (every row once a round, one epoch each after a warm-up
one); labels only also on DALI's classic executor (which the pipelines with points' maps ran on before `DaliIterator`),
to tell the executor's share from the points' own; then the host's time in one epoch of points and of boxes (cProfile).

    python scripts/targets_dali_side.py FOLDER [ROUNDS]   # FOLDER: train/ and valid/ class folders of JPEGs (the bench's data_N)
"""
import sys, time, warnings, cProfile, pstats, io
import torch
from pathlib import Path
from fastai.vision.all import Resize, Normalize, imagenet_stats, RandomResizedCrop, aug_transforms
from fastai_dali.bench import target_blocks
import fastai_dali.data  # (DataBlock.dali_dataloaders)
import fastai_dali.feed as feed

dev = 'cuda' if torch.cuda.is_available() else 'cpu'  # (the CPU: only to try the script)
def sync():
    if dev == 'cuda': torch.cuda.synchronize()

def img_s(it):
    "Items a second over one pass of `it` (batches whose first element is a batch of items, or DALI's (outputs, k))"
    sync(); t,n = time.perf_counter(),0
    for o in it: n += o[1] if isinstance(o[1], int) else len(o[0])
    sync()
    return round(n/(time.perf_counter() - t))

def classic(f):
    "`fastai_pipeline` `f` on DALI's classic executor"
    return lambda *a, **kw: f(*a, **{**kw, 'exec_dynamic': False})

def loaders(root, it, bt):
    "The train loaders of `target_blocks`, labels only twice: on DALI's default executor, then on its classic one"
    dls,orig = {},feed.fastai_pipeline
    for name,db in target_blocks(it, bt).items():
        if 'labels' in name:
            feed.fastai_pipeline = classic(orig)
            try:
                d = db.dali_dataloaders(root, bs=128, device=dev).train
                for _ in d: pass  # (builds its pipeline now, on the classic executor)
            finally: feed.fastai_pipeline = orig
            dls[name + ', classic executor'] = d
        dls[name] = db.dali_dataloaders(root, bs=128, device=dev).train
    return dls

def profile(dl, n=14):
    "The host's time in one epoch of `dl`, most first"
    pr = cProfile.Profile(); pr.enable()
    for _ in dl: pass
    sync(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats('tottime').print_stats(n)
    return '\n'.join(l for l in s.getvalue().splitlines() if l.strip() and 'Ordered by' not in l and 'List reduced' not in l)

def torch_profile(dl, n=12):
    "torch's profiler over one epoch of `dl`: the ops and copies the loader adds on the host and the device, most host time first"
    from torch.profiler import profile as tprofile, ProfilerActivity
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == 'cuda' else [])
    with tprofile(activities=acts) as pr:
        for _ in dl: pass
        sync()
    return pr.key_averages().table(sort_by='self_cpu_time_total', row_limit=n)

def used_gb():
    "The device memory in use by this process and others (DALI's pools included), GB"
    if dev != 'cuda': return 0.
    free,total = torch.cuda.mem_get_info()
    return round((total - free)/1e9, 2)

def main(root, rounds=2):
    warnings.simplefilter('ignore')
    norm = Normalize.from_stats(*imagenet_stats)
    pipelines = {'Resize': (Resize(224), [norm]), 'RandomResizedCrop': (RandomResizedCrop(224, min_scale=0.35), [norm]),
                 'RandomResizedCrop + aug_transforms()': (RandomResizedCrop(224, min_scale=0.35), [*aug_transforms(), norm])}
    for p,(it,bt) in pipelines.items():
        dls,before = loaders(root, it, bt),used_gb()
        for k,dl in dls.items():
            for _ in dl: pass
            print(f'{p}, {k}: device memory in use after its first epoch {used_gb()} GB (before the first: {before})', flush=True)
        res = {k: [] for k in dls}
        for r in range(rounds):
            for k,dl in dls.items():
                res[k].append((img_s(dl.feed.epoch(dl.feed.ready(dl.spec(), dl.get_idxs))), img_s(dl)))
        for k,v in res.items():
            print(f"{p}, {k}: DALI's side {[a for a,_ in v]}, the loader {[b for _,b in v]} img/s", flush=True)
        if p.endswith('aug_transforms()'):
            for k,dl in dls.items():
                if 'labels' not in k or 'classic' in k:
                    print(f'\nhost time, one epoch: {p}, {k}\n{profile(dl)}', flush=True)
                    print(f'\ntorch profiler, one epoch: {p}, {k}\n{torch_profile(dl)}', flush=True)
        del dls

if __name__ == '__main__': main(Path(sys.argv[1]), *map(int, sys.argv[2:]))

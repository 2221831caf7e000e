"""`learn.fit` img/s of what a `Learner` over `DaliDataLoaders` trains by default (`DaliFastPathCallback`: fastai's optimizer's
foreach twin and `DeviceLossCallback`), beside fastai's own loop on the same loaders (`dls.fast_path = False`), the
same path written out (`opt_func=ForeachAdam`, `cbs=DeviceLossCallback()`), the model on synthetic GPU batches, the
defaults plus `cbs=CudaGraphCallback()`, the plain PyTorch loop graphed (the ceiling), and `ImageDataLoaders`; for
resnet18 also the defaults with DALI's `num_threads` 4 and 8. Every row one epoch a round (`fit_rounds`: a warm-up
epoch, then 2 rounds), random init, bf16, channels_last, bs 128, 224 px, 10,000 JPEGs (`make_bench_dataset`).

    python scripts/training_defaults.py OUT [ARCHS] [ROOT]     (a GPU; ARCHS default resnet18,resnet50)

Writes OUT/training_defaults.json and prints a markdown table per arch, ratios to fastai's own loop.
"""
import json, sys, time, os, tempfile
from fastai.vision.all import Resize, Normalize, imagenet_stats, models, DataLoaders, ImageDataLoaders
from fastai_dali.data import DaliDataLoaders
from fastai_dali.training import DeviceLossCallback
from fastai_dali.graphs import CudaGraphCallback
from fastai_dali.optimizer import ForeachAdam
from fastai_dali.samples import make_bench_dataset
from fastai_dali.bench.training import fit_epochs, torch_loop_epochs, fit_rounds, SyntheticDL, ROW_FAST, ROW_DEFAULT, ROW_PLAIN_GRAPHS

OWN = "DaliDataLoaders, fastai's own loop (dls.fast_path=False)"

def main(out, archs='resnet18,resnet50', root=os.path.join(tempfile.gettempdir(), 'bt/data_10000')):
    make_bench_dataset(root, 10000)
    kw = dict(item_tfms=Resize(224), batch_tfms=Normalize.from_stats(*imagenet_stats), bs=128, device='cuda')
    dls = DaliDataLoaders.from_folder(root, **kw)
    idls = ImageDataLoaders.from_folder(root, **kw, num_workers=16)
    dls_t = {t: DaliDataLoaders.from_folder(root, **kw, num_threads=t) for t in (4, 8)}
    res = {}
    for a in archs.split(','):
        t = time.time(); arch = getattr(models, a)
        sdl = SyntheticDL(bs=128, size=224, n_batches=len(dls.train), c=dls.c, device='cuda'); syn = DataLoaders(sdl, sdl)
        rows = {OWN: lambda: fit_epochs(dls, arch, dls.c),
                ROW_DEFAULT: lambda: fit_epochs(dls, arch, dls.c, fast_path=True),
                ROW_FAST: lambda: fit_epochs(dls, arch, dls.c, cbs=[DeviceLossCallback()], opt_func=ForeachAdam),
                'model only, ForeachAdam, DeviceLossCallback': lambda: fit_epochs(syn, arch, dls.c, cbs=[DeviceLossCallback()], opt_func=ForeachAdam),
                f"{ROW_DEFAULT}, CudaGraphCallback": lambda: fit_epochs(dls, arch, dls.c, fast_path=True, cbs=[CudaGraphCallback()]),
                ROW_PLAIN_GRAPHS: lambda: torch_loop_epochs(sdl, arch, dls.c, opt='adamw_fused', graphs=True),
                "ImageDataLoaders (16 workers), fastai's own loop": lambda: fit_epochs(idls, arch, dls.c),
                **({f'{ROW_DEFAULT}, num_threads={t}': (lambda d: lambda: fit_epochs(d, arch, dls.c, fast_path=True))(d) for t,d in dls_t.items()}
                   if a == 'resnet18' else {})}
        med,runs = fit_rounds(rows, epochs=3)
        res[a] = dict(median=med, rounds=runs, seconds=time.time()-t)
        print(f"\n### {a} ({time.time()-t:.0f} s)\n\n| row | img/s | rounds | ÷ fastai's own loop |\n|---|---:|---:|---:|")
        for k,v in med.items(): print(f"| {k} | {v:,.0f} | {' / '.join(f'{x:,.0f}' for x in runs[k])} | {v/med[OWN]:.2f} |", flush=True)
        json.dump(res, open(f'{out}/training_defaults.json', 'w'), indent=1)

if __name__ == '__main__': main(*sys.argv[1:])

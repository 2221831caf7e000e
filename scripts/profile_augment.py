"""Where does aug_transforms' time go on the GPU path? One loader per augmentation step, same files, one run.

    python scripts/profile_augment.py --data /tmp/fastai_dali_bench_10000   (a folder made by gpu_check.py)
"""
import argparse, json, os
from pathlib import Path
from fastai.vision.all import (Resize, Normalize, imagenet_stats, aug_transforms, Flip, Rotate, Zoom, Warp, Brightness,
                               Contrast, Saturation, Hue, RandomErasing, RandomResizedCrop, FlipItem)
from fastai_dali.all import DaliDataLoaders
from fastai_dali.bench import compare_loaders, results_markdown

def main():
    ap = argparse.ArgumentParser(); ap.add_argument('--data', default='/tmp/fastai_dali_bench_10000')
    ap.add_argument('--bs', type=int, default=128); ap.add_argument('--out', default=os.environ.get('OUT', '/tmp/out'))
    ap.add_argument('--max-batches', type=int, default=50)
    a = ap.parse_args()
    norm = Normalize.from_stats(*imagenet_stats)
    cases = {'Resize + Normalize (no augmentation)': (Resize(224), []),
             'FlipItem (item)': ([FlipItem(), Resize(224)], []),
             'Flip (batch, one warp)': (Resize(224), [Flip()]),
             'Rotate': (Resize(224), [Rotate()]),
             'Warp': (Resize(224), [Warp()]),
             'Brightness + Contrast': (Resize(224), [Brightness(), Contrast()]),
             'Saturation': (Resize(224), [Saturation()]),
             'Hue': (Resize(224), [Hue()]),
             'RandomErasing (after Normalize)': (Resize(224), [RandomErasing()]),
             'aug_transforms()': (Resize(224), aug_transforms()),
             'RandomResizedCrop only': (RandomResizedCrop(224, min_scale=0.35), [])}
    loaders = {}
    for k,(it,bt) in cases.items():
        dls = DaliDataLoaders.from_folder(a.data, item_tfms=it, batch_tfms=[*bt, norm], bs=a.bs, device='cuda')
        assert all(dls.train.dali_report().how == 'native'), dls.train.dali_report()
        loaders[k] = (lambda d: lambda: d.train)(dls)
    res = compare_loaders(loaders, max_batches=a.max_batches, warmup=3, repeats=2)
    md = results_markdown(res, f'aug_transforms steps, bs {a.bs}, 224 px, DaliDataLoaders train')
    print(md); Path(a.out).mkdir(parents=True, exist_ok=True); (Path(a.out)/'profile_augment.md').write_text(md+'\n')

if __name__ == '__main__': main()

"""show_batch grids of augmented training batches: DaliDataLoaders next to ImageDataLoaders, same folder, same transforms.

    python scripts/show_augment.py --out docs/images [--device cuda]

Writes augment_dali.png and augment_fastai.png (RandomResizedCrop + aug_transforms with a visible warp and lighting),
and augment_masks_dali.png (a segmentation batch: masks drawn over their augmented images).
"""
import argparse, os, tempfile
os.environ.setdefault('MPLBACKEND', 'Agg')
from pathlib import Path
import matplotlib.pyplot as plt
from fastai.vision.all import (ImageDataLoaders, RandomResizedCrop, aug_transforms, Normalize, imagenet_stats, set_seed,
                               Saturation, DataBlock, ImageBlock, MaskBlock, GrandparentSplitter, FlipItem, Resize)
from fastai_dali.all import DaliDataLoaders
from fastai_dali.samples import make_image_folder

def main():
    ap = argparse.ArgumentParser(); ap.add_argument('--out', default='docs/images'); ap.add_argument('--device', default='cpu')
    a = ap.parse_args(); out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    path = make_image_folder(Path(tempfile.mkdtemp())/'photos', n_train=36, n_valid=8, min_size=160, max_size=320)
    kw = dict(item_tfms=RandomResizedCrop(128, min_scale=0.35),
              batch_tfms=[*aug_transforms(max_rotate=20, max_warp=0.3, max_lighting=0.4), Saturation(0.4),
                          Normalize.from_stats(*imagenet_stats)], bs=16, device=a.device)
    for name,cls,extra in (('dali', DaliDataLoaders, {}), ('fastai', ImageDataLoaders, dict(num_workers=0))):
        set_seed(0)
        dls = cls.from_folder(path, **kw, **extra)
        dls.show_batch(max_n=12, nrows=3, ncols=4, figsize=(10, 8))
        plt.suptitle(f'{cls.__name__}: RandomResizedCrop(128, min_scale=0.35) + aug_transforms(max_rotate=20, max_warp=0.3, max_lighting=0.4) + Saturation(0.4)', fontsize=8)
        plt.savefig(out/f'augment_{name}.png', dpi=80, bbox_inches='tight'); plt.close('all')
        if name == 'dali': print(dls.train.dali_report().to_string())
    # masks: boxes on photos-like noise, the box is the mask (see tests/test_segmentation.py)
    import sys; sys.path.insert(0, str(Path(__file__).parents[1]/'tests'))
    from test_segmentation import make_boxes, image_files, label_file
    root = make_boxes(Path(tempfile.mkdtemp())/'seg', n_train=16)
    db = DataBlock(blocks=(ImageBlock, MaskBlock(codes=['bg','box'])), get_items=image_files, get_y=label_file,
                   splitter=GrandparentSplitter(), item_tfms=[FlipItem(), RandomResizedCrop(96, min_scale=0.5)],
                   batch_tfms=aug_transforms(max_rotate=30, max_warp=0.3))
    db.dali_dataloaders(root, bs=8, device=a.device).show_batch(max_n=8, nrows=2, ncols=4, figsize=(10, 5))
    plt.savefig(out/'augment_masks_dali.png', dpi=80, bbox_inches='tight'); plt.close('all')
    print('wrote', sorted(p.name for p in out.glob('augment_*.png')))

if __name__ == '__main__': main()

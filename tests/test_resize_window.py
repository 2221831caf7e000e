"""`Resize`'s crop window: DALI must crop the pixels fastai's `Resize` crops, on the validation and the training split.

fastai (`Resize.encodes`) crops the largest window of the target's aspect ratio, `int(m*w)` by `int(m*h)` with
`m = min(W/w, H/h)`, at `int(p*(W-cw))` (`p` = 0.5 on the validation split, uniform in [0, 1) on the training split),
then resizes the window with PIL. With the same window, DALI's pixels differ from fastai's only by the JPEG decoder
(measured here, per image: DALI's decoder against PIL's) and by the resampling arithmetic (DALI's antialiased linear
filter and PIL's bilinear reduce, each rounding to uint8: under one level per pixel on average). So each image's mean
|Δ| to fastai must stay within its decoder's mean |Δ| + 1 level, and the integer shift that best aligns it with
fastai's image must be 0: a window one pixel off shows as a whole-pixel shift.

Measured on DALI 2.4's CPU backend against fastai 2.8.7, on the 56 valid images of `window_folder` below (0..255
units; "before" is the resize-then-crop translation this file was written against). DALI's CPU decoder gives PIL's
pixels exactly (decoder |Δ| 0.000 for every image), so on the CPU the bound is 1 level per image:

    Resize      before: resize, crop in crop_mirror_normalize     after: window, crop, resize
                mean   worst image  images shifted                mean   worst image  images shifted
    48          2.87   8.80         18/56                         0.16   0.25         0
    47          3.89   9.71         27/56                         0.16   0.19         0
    (48, 64)    3.44   9.23         29/56                         0.16   0.20         0
    224         2.93   8.02         41/56                         0.16   0.24         0
    presizing, Resize(96) + aug_transforms(size=48): mean 3.13 -> 0.31, shifted 10/56 -> 0;
    Resize(460) + aug_transforms(size=224): mean 2.35 -> 0.71 (the rest is the warp's resampling), shifted 30/56 -> 0.

The training split's windows are checked on PNGs (lossless) whose window needs no resize (a 48 px target on
images 48 px high): each output is then exactly one window of its image, so its offset can be read off.
"""
import os
from pathlib import Path

import numpy as np, pytest, torch
from PIL import Image
from fastai.vision.all import ImageDataLoaders, Resize, PILImage, set_seed
from fastai_dali.data import DaliDataLoaders
from fastai_dali.core import dali_device_id
from nvidia.dali import pipeline_def, fn, types

from conftest import PARITY_STATS, photos, plain

DEVICE = os.environ.get('FASTAI_DALI_TEST_DEVICE', 'cpu')

def photo_crop(rng, h, w, min_std=40):
    "A textured `h` x `w` crop of a scikit-image photo (resized from a smaller crop where no photo is large enough)"
    while True:
        p = photos()[rng.integers(len(photos()))]
        hh,ww = min(h, p.shape[0]),min(w, p.shape[1])
        y,x = int(rng.integers(0, p.shape[0]-hh+1)), int(rng.integers(0, p.shape[1]-ww+1))
        c = p[y:y+hh, x:x+ww]
        if (hh,ww) != (h,w): c = np.asarray(Image.fromarray(c).resize((w,h), Image.BICUBIC))
        if c.std() >= min_std: return np.ascontiguousarray(c)

# (H, W): 40..200 px with odd and even margins in both orientations, a few 300..640 px, and sides where fastai's
# float64 window is one pixel short of the image (int(S/t*t) < S: 48 and 51 for 47, 230 for 224)
_FIXED = [(40,41), (41,40), (40,42), (42,40), (57,90), (90,57), (64,97), (97,64), (120,121), (121,120), (150,199),
          (199,150), (200,173), (173,200), (48,48), (47,48), (51,100), (100,51), (62,75), (75,62), (99,160), (160,99),
          (300,451), (451,300), (333,640), (640,333), (480,639), (230,400), (400,230), (61,90)]

def window_shapes(seed=1, n_random=26):
    rng = np.random.default_rng(seed)
    return _FIXED + [tuple(int(o) for o in rng.integers(40, 201, size=2)) for _ in range(n_random)]

@pytest.fixture(scope='module')
def window_folder(tmp_path_factory):
    root,rng = tmp_path_factory.mktemp('window'),np.random.default_rng(0)
    for i,(h,w) in enumerate(window_shapes()):
        for split in ('train', 'valid'):
            f = root/split/'a'/f'{i:03d}_{h}x{w}.jpg'
            f.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(photo_crop(rng, h, w)).save(f, quality=90)
    return root

def valid_pixels(dl): return torch.cat([plain(b[0]) for b in dl])

@pipeline_def
def _decode(files):
    jpegs,_ = fn.readers.file(files=[str(f) for f in files])
    gpu = dali_device_id(DEVICE) is not None
    kw = dict(hw_decoder_load=1.0) if gpu else {}   # DaliDataLoaders' default
    return fn.decoders.image(jpegs, device='mixed' if gpu else 'cpu', output_type=types.RGB, adjust_orientation=False, **kw)

def decoder_diff(files, bs=16):
    "Mean |DALI's decoded pixels - PIL's| of each file, in 0..255 units"
    p = _decode(files, batch_size=bs, num_threads=2, device_id=dali_device_id(DEVICE), seed=0)
    p.build()
    res = []
    for _ in range(-(-len(files)//bs)):
        out = p.run()[0]
        if hasattr(out, 'as_cpu'): out = out.as_cpu()
        res += [np.array(o) for o in out]
    return [float(np.abs(d.astype(np.float32) - np.asarray(PILImage.create(f), dtype=np.float32)).mean())
            for d,f in zip(res, files)]

def best_shift(a, b, r=2):
    "The integer shift (dy, dx), |dy|,|dx| <= r, that best aligns images `a` and `b` (C,H,W): least mean |Δ| on the overlap"
    H,W = a.shape[1:]
    def d(dy, dx):
        aa = a[:, max(dy,0):H+min(dy,0), max(dx,0):W+min(dx,0)]
        bb = b[:, max(-dy,0):H+min(-dy,0), max(-dx,0):W+min(-dx,0)]
        return (aa-bb).abs().mean().item()
    return min(((dy, dx) for dy in range(-r, r+1) for dx in range(-r, r+1)), key=lambda s: d(*s))

SIZES = {'48': 48, '47': 47, '48x64': (48, 64), '224': 224}

@pytest.mark.parametrize('size', list(SIZES))
def test_valid_window_like_fastai(window_folder, size):
    tfm = Resize(SIZES[size])
    dd = DaliDataLoaders.from_folder(window_folder, item_tfms=tfm, bs=16, device=DEVICE)
    fd = ImageDataLoaders.from_folder(window_folder, item_tfms=Resize(SIZES[size]), bs=16, device='cpu', num_workers=0)
    files = list(dd.valid_ds.items)
    assert files == list(fd.valid_ds.items)
    x,f = valid_pixels(dd.valid),valid_pixels(fd.valid)
    assert x.shape == f.shape
    d = (x-f).abs()*255
    per_img = d.flatten(1).mean(1).tolist()
    dec = decoder_diff(files)
    shifts = [best_shift(a, b) for a,b in zip(x, f)]
    PARITY_STATS[f"window  {size:<7}crop valid"] = dict(mean=d.mean().item(), img_mean=max(per_img),
                                                         p999=d.flatten().quantile(0.999).item(), max=d.max().item())
    name = lambda i: Path(files[i]).name
    shifted = {name(i): s for i,s in enumerate(shifts) if s != (0, 0)}
    assert not shifted, f"images shifted against fastai's (dy, dx): {shifted}"
    over = {name(i): (round(m, 2), round(dec[i], 2)) for i,m in enumerate(per_img) if m > dec[i] + 1.0}
    assert not over, f"images whose mean |Δ| to fastai exceeds their JPEG decoder's |Δ| + 1 (mean, decoder): {over}"

@pytest.mark.parametrize('pre,size', [(96, 48), (460, 224)])
def test_presizing_not_shifted(window_folder, pre, size):
    "Presizing: `Resize(pre)` then `aug_transforms(size=size)`, which on the validation split only resizes: no image shifted"
    from fastai.vision.all import aug_transforms
    kw = lambda: dict(item_tfms=Resize(pre), batch_tfms=aug_transforms(size=size), bs=16)
    dd = DaliDataLoaders.from_folder(window_folder, device=DEVICE, **kw())
    fd = ImageDataLoaders.from_folder(window_folder, device='cpu', num_workers=0, **kw())
    x,f = valid_pixels(dd.valid),valid_pixels(fd.valid)
    d = (x-f).abs()*255
    PARITY_STATS[f"window  presize {pre}->{size}"] = dict(mean=d.mean().item(), img_mean=d.flatten(1).mean(1).max().item(),
                                                           p999=d.flatten().quantile(0.999).item(), max=d.max().item())
    shifted = {Path(p).name: s for p,a,b in zip(dd.valid_ds.items, x, f) if (s := best_shift(a, b)) != (0, 0)}
    assert not shifted, f"images shifted against fastai's (dy, dx): {shifted}"

# ------------------------------------------------------------------------------------------- the training split
# 48 px high (wide) or wide (tall) PNGs, target 48: the window is 48x48 at offset 0..D-1 along the long side, D = 5 or 7
_TRAIN_SHAPES = [(48, 53), (53, 48), (48, 55), (55, 48)]

@pytest.fixture(scope='module')
def offset_folder(tmp_path_factory):
    root,rng = tmp_path_factory.mktemp('offsets'),np.random.default_rng(5)
    imgs = {}
    for split in ('train', 'valid'):
        for i in range(24):
            h,w = _TRAIN_SHAPES[i % len(_TRAIN_SHAPES)]
            a = photo_crop(rng, h, w, min_std=50)
            f = root/split/'a'/f'{i:02d}_{h}x{w}.png'
            f.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(a).save(f)
            imgs[str(f)] = a
    return root, imgs

def _candidates(imgs, files):
    "Every 48x48 window of each of `files`: (file index, offset along the long side, axis) and the windows, as CHW 0..1"
    keys,wins = [],[]
    for i,f in enumerate(files):
        a = imgs[str(f)]
        H,W = a.shape[:2]
        for o in range(max(H, W) - 48 + 1):
            keys.append((i, o, 'y' if H > W else 'x'))
            wins.append(a[o:o+48] if H > W else a[:, o:o+48])
    return keys, torch.tensor(np.stack(wins)).permute(0,3,1,2).float()/255

def offsets(batches, imgs, files):
    "The (file index, offset, axis) of each output image: the window of a file it equals"
    keys,wins = _candidates(imgs, files)
    x = torch.cat([plain(b[0]) for b in batches])
    d = torch.cdist(x.flatten(1), wins.flatten(1), p=1) / wins[0].numel() * 255
    best,idx = d.min(1)
    assert (best < 1).all(), f"outputs that are no window of their image (min mean |Δ| {best.max():.2f}/255)"
    return [keys[i] for i in idx.tolist()]

def test_valid_centre_truncates(offset_folder):
    "An odd margin D: fastai's centre window starts at int(0.5*D) = D//2, never rounded up"
    root,imgs = offset_folder
    dd = DaliDataLoaders.from_folder(root, item_tfms=Resize(48), bs=8, device=DEVICE)
    fd = ImageDataLoaders.from_folder(root, item_tfms=Resize(48), bs=8, device='cpu', num_workers=0)
    files = list(dd.valid_ds.items)
    want = [(i, (max(imgs[str(f)].shape[:2]) - 48)//2) for i,f in enumerate(files)]
    assert [k[:2] for k in offsets(list(fd.valid), imgs, files)] == want   # fastai's own, as read in its code
    assert [k[:2] for k in offsets(list(dd.valid), imgs, files)] == want

def test_train_windows_drawn_like_fastai(offset_folder):
    "fastai draws int(p*D), p ~ U[0,1): offsets 0..D-1, uniformly, never D (DALI's default rounding reaches D)"
    from scipy.stats import chi2_contingency
    root,imgs = offset_folder
    set_seed(0)
    dd = DaliDataLoaders.from_folder(root, item_tfms=Resize(48), bs=8, device=DEVICE)
    fd = ImageDataLoaders.from_folder(root, item_tfms=Resize(48), bs=8, device='cpu', num_workers=0)
    files = list(dd.train_ds.items)
    assert files == list(fd.train_ds.items)
    n_epochs = 12   # 12 draws of each of 24 images: 72 per (margin, axis)
    ours = [k for _ in range(n_epochs) for k in offsets(list(dd.train), imgs, files)]
    theirs = [k for _ in range(n_epochs) for k in offsets(list(fd.train), imgs, files)]
    assert len(ours) == len(theirs) == n_epochs*len(files)
    for D in (5, 7):
        for ax in ('x', 'y'):
            sel = lambda ks: [o for i,o,a in ks if a == ax and max(imgs[str(files[i])].shape[:2]) - 48 == D]
            o,t = sel(ours),sel(theirs)
            assert set(t) == set(range(D)), (D, ax, sorted(set(t)))   # fastai: every offset 0..D-1, never D
            assert set(o) == set(range(D)), f"margin {D} ({ax}): offsets drawn {sorted(set(o))}, fastai's are 0..{D-1}"
            counts = np.array([[o.count(k) for k in range(D)], [t.count(k) for k in range(D)]])
            p = chi2_contingency(counts).pvalue
            assert p > 1e-3, f"margin {D} ({ax}): offsets not drawn like fastai's: {counts.tolist()} (p={p:.2g})"

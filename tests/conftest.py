"""Shared fixtures for the parity tests: small ImageNet-style JPEG folders made from scikit-image photos.

Everything is generated under pytest's tmp dir (nothing goes into git). Images are random crops of the photos
bundled with scikit-image, 40..160 px on each side (so many aspect ratios), saved by PIL as JPEG quality 90.
Classes get items round-robin, so class sizes are uneven when `n` is not a multiple of the number of classes.
"""
import os, threading, warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault('MPLBACKEND', 'Agg')
warnings.filterwarnings('ignore', message='.*torch.jit.script.*', category=FutureWarning)

import numpy as np, pytest, torch
from torch import nn
import torch.nn.functional as F
from PIL import Image

# The DALI side runs where FASTAI_DALI_TEST_DEVICE says: 'cpu' (CI, DALI's CPU backend) or 'cuda' (a GPU machine,
# GPU JPEG decode); fastai's side always runs on the CPU. Batches are compared on the CPU.
DEVICE = os.environ.get('FASTAI_DALI_TEST_DEVICE', 'cpu')
# Same model, same image, loaded twice: on the GPU the JPEG decoder differs between batch sizes (nvJPEG's hardware
# decoder takes batches, its CUDA decoder single images) and from the CPU's; measured on an H200 <= 0.0015
PRED_ATOL = 1e-4 if DEVICE == 'cpu' else 5e-3

def plain(t): return t.as_subclass(torch.Tensor).cpu() if isinstance(t, torch.Tensor) else t

def epoch(dl):
    "All batches of one epoch of `dl`, as plain tensors"
    return [tuple(plain(o) for o in b) for b in dl]

def run_with_timeout(fn, timeout=90):
    "Run `fn()` in a thread: a hang fails the test instead of blocking the run"
    res = {}
    def _target():
        try: res['value'] = fn()
        except BaseException as e: res['error'] = e
    t = threading.Thread(target=_target, daemon=True)
    t.start(); t.join(timeout)
    assert not t.is_alive(), f"no result and no error after {timeout}s: the loader hangs"
    if 'error' in res: raise res['error']
    return res.get('value')


CLASSES = ('cat', 'dog', 'fish')
_PHOTOS = ('astronaut', 'coffee', 'chelsea', 'rocket', 'immunohistochemistry')
_photo_cache = []

def photos():
    "RGB uint8 photos bundled with scikit-image (no download)"
    if not _photo_cache:
        import skimage.data as sd
        _photo_cache.extend(getattr(sd, n)()[..., :3] for n in _PHOTOS)
    return _photo_cache

def random_crop(rng, lo=40, hi=160, min_std=40):
    "A random crop of a random photo, `lo`..`hi` px on each side (independently, so any aspect ratio)"
    while True:  # flat crops (sky, background) look alike once resized: the tests identify images by their pixels
        p = photos()[rng.integers(len(photos()))]
        h,w = (int(o) for o in rng.integers(lo, hi+1, size=2))
        y,x = (int(o) for o in (rng.integers(0, p.shape[0]-h+1), rng.integers(0, p.shape[1]-w+1)))
        crop = p[y:y+h, x:x+w]
        if crop.std() >= min_std: return np.ascontiguousarray(crop)

def save_jpeg(arr, fn, quality=90):
    fn = Path(fn); fn.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(fn, quality=quality)
    return fn

def make_image_folder(root, n_train, n_valid, classes=CLASSES, seed=0, lo=40, hi=160):
    "ImageNet-style `root/{train,valid}/<class>/*.jpg` with `n_train`/`n_valid` images per split"
    rng,root = np.random.default_rng(seed),Path(root)
    for split,n in (('train', n_train), ('valid', n_valid)):
        for c in classes: (root/split/c).mkdir(parents=True, exist_ok=True)
        for k in range(n):
            c = classes[k % len(classes)]
            save_jpeg(random_crop(rng, lo, hi), root/split/c/f'{c}_{split}_{k:03d}.jpg')
    return root

@pytest.fixture(scope='session')
def image_folder(tmp_path_factory):
    "Factory: `image_folder(n_train, n_valid, seed=0)` -> path of a (cached) generated folder"
    cache = {}
    def _make(n_train, n_valid, seed=0, classes=CLASSES):
        key = (n_train, n_valid, seed, tuple(classes))
        if key not in cache:
            cache[key] = make_image_folder(tmp_path_factory.mktemp(f'imgs_{n_train}_{n_valid}_{seed}'),
                                           n_train, n_valid, classes=classes, seed=seed)
        return cache[key]
    return _make

@pytest.fixture(scope='session')
def folder30(image_folder):
    "30 train + 30 valid images in 3 classes: the folder for pixel parity and training"
    return image_folder(30, 30)

def build_at_once(*dls, timeout=300):
    """Build the DALI pipelines of loaders `dls` (one batch each), from one thread each, and wait for all.
    A loader whose `get_x` runs in worker processes spawns them when its pipeline is built, and each worker imports
    torch and fastai first: ~13 s on the H200, one loader after the other. Built at once, those spawns overlap.
    Each loader is left in an abandoned epoch, which its next epoch ends (a Python source keeps its pipeline)"""
    ex = ThreadPoolExecutor(len(dls))
    try:
        for f in [ex.submit(dl.one_batch) for dl in dls]: f.result(timeout)  # a hang: TimeoutError, a failure: its error
    finally: ex.shutdown(wait=False)

# Measured DALI-vs-fastai pixel differences, filled by test_parity.py and printed at the end of the run
PARITY_STATS = {}

def pytest_terminal_summary(terminalreporter):
    if not PARITY_STATS: return
    tr = terminalreporter
    tr.section('DALI vs fastai pixel differences (0..255 units)')
    tr.write_line(f"{'case':<42}{'mean|d|':>9}{'worst img mean':>16}{'p99.9':>8}{'max|d|':>8}")
    for k,v in sorted(PARITY_STATS.items()):
        tr.write_line(f"{k:<42}{v['mean']:>9.3f}{v['img_mean']:>16.3f}{v['p999']:>8.1f}{v['max']:>8.1f}")

# ------------------------------------------------------------------ images that carry their item id (exactness tests)
CLS = ('a', 'b', 'c')
VALID0 = 500  # valid ids are VALID0.., train ids 0..

def cls_of(i): return CLS[i % 3]

def make_id_folder(root, n_train=43, n_valid=22, start=0):
    "`root/{train,valid}/<class>/<id>.png`, 8x8 solid images whose colour encodes the id"
    root = Path(root)
    for split,ids in (('train', range(start, start+n_train)), ('valid', range(start+VALID0, start+VALID0+n_valid))):
        for i in ids:
            a = np.zeros((8, 8, 3), np.uint8); a[..., 0], a[..., 1], a[..., 2] = i % 256, i // 256, 60*CLS.index(cls_of(i))
            fn = root/split/cls_of(i)/f'{i:04d}.png'; fn.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(a).save(fn)
    return root

def id_of(f): return int(Path(f).stem)

def decode_ids(x):
    "Item id of each image of batch `x` (0..1 floats); -1 where the pixels are not one solid colour"
    x = (x.as_subclass(torch.Tensor).float()*255).round().long()
    lo,hi = x[:, 0].flatten(1),x[:, 1].flatten(1)
    solid = (lo.min(1).values == lo.max(1).values) & (hi.min(1).values == hi.max(1).values)
    return torch.where(solid, lo[:, 0] + 256*hi[:, 0], torch.full_like(lo[:, 0], -1))

def ids_of(x): return plain(decode_ids(x)).tolist()

class IdNet(nn.Module):
    "A linear classifier on the mean colour, plus one more column: the id its input encodes"
    def __init__(self, n_cls=3): super().__init__(); self.lin = nn.Linear(3, n_cls)
    def forward(self, x):
        x = x.as_subclass(torch.Tensor)
        return torch.cat([self.lin(x.mean((2, 3))), decode_ids(x)[:, None].float()], 1)

class IdLoss:
    "Cross entropy on the class columns; predictions keep the id column"
    def __call__(self, out, y): return F.cross_entropy(out[:, :-1], y.as_subclass(torch.Tensor))
    def activation(self, out): return torch.cat([F.softmax(out[:, :-1], -1), out[:, -1:]], 1)
    def decodes(self, out): return out[:, :-1].argmax(-1)


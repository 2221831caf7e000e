"""Item order: what fastai's `get_idxs` and seeds decide, `DaliDL` must decide too.

- `show_batch(unique=True)` (fastbook's way to look at one image's augmentations) replaces `get_idxs` with an endless
  iterator of zeros and reads one batch: the batch is item 0, `bs` times (augmented on train), and the iterator is read
  lazily: at most one epoch's worth of indices (it used to be turned into a list, without bound, on a validation loader).
- Any `get_idxs` that fastai or a callback installs is honoured, in its order; fastai's own comes back afterwards.
- The training order follows the loader's seed: `set_seed(n)` before building the loaders gives the same orders, a
  different seed different ones, and masks stay with their images (their reader shuffles in lock-step).
Every item is a tiny lossless PNG whose pixels encode its index, so a delivered sample says which item it is.
"""
import itertools, numpy as np, pytest, torch
from pathlib import Path
from PIL import Image
from fastai.vision.all import (DataBlock, ImageBlock, CategoryBlock, MaskBlock, FuncSplitter, FlipItem, Resize, Inf,
                               set_seed)
from fastai_dali.data import DaliDataLoaders
from conftest import DEVICE, plain, run_with_timeout, id_tensor

N = 40

def write_items(root, n=N, masks=False):
    "`n` 6x6 PNGs whose red/green channels hold the item index (and a mask per image holding the index mod 256)"
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        a = np.zeros((6, 6, 3), np.uint8); a[..., 0], a[..., 1] = i % 256, i // 256
        a[0, 0, 2] = 255  # a corner mark, so a flip shows
        Image.fromarray(a).save(root/f'{i:04d}.png')
        if masks: Image.fromarray(np.full((6, 6), i % 256, np.uint8)).save(root/f'{i:04d}_m.png')
    return sorted(f for f in root.glob('*.png') if not f.stem.endswith('_m'))

@pytest.fixture(scope='module')
def items(tmp_path_factory): return write_items(tmp_path_factory.mktemp('order'), masks=True)

def idx_of(f): return int(Path(f).stem[:4])
def is_valid(f): return idx_of(f) % 4 == 3

def dls_of(items, get_x=None, item_tfms=None, **kwargs):
    dblock = DataBlock(blocks=(ImageBlock, CategoryBlock(vocab=[str(i) for i in range(N)])), get_items=lambda _: items,
                       get_x=get_x, get_y=lambda f: str(idx_of(f)), splitter=FuncSplitter(is_valid), item_tfms=item_tfms)
    return DaliDataLoaders.from_dblock(dblock, None, device=DEVICE, num_threads=1, py_workers=0, **kwargs)

def ids(x):
    "Item index of each image of a batch (from the pixels of its top-right corner, never flipped onto by a corner mark)"
    return id_tensor(x, at=(0, 3)).tolist()

def order(dl, epochs=1): return [ids(x) for _ in range(epochs) for x,_ in dl]

class CountingZeros:
    "An endless iterator of zeros, as `show_batch(unique=True)` installs, that counts what is read from it"
    def __init__(self): self.read = 0
    def __call__(self):
        for _ in itertools.count(): self.read += 1; yield 0

# ------------------------------------------------------------------------------------------------ show_batch(unique)
@pytest.mark.parametrize('split', ['valid', 'train'])
def test_unique_batch_is_item_zero(items, split):
    "A `get_idxs` of endless zeros: one batch of item 0, read lazily (at most one epoch of indices), then fastai's order back"
    dls = dls_of(items, bs=8, seed=0, item_tfms=FlipItem(p=0.5))
    dl = getattr(dls, split)
    first = dl.items[0]
    zeros = CountingZeros()
    old = dl.get_idxs; dl.get_idxs = zeros
    try: x,y = run_with_timeout(dl.one_batch, 60)
    finally: dl.get_idxs = old
    assert zeros.read <= len(dl.dataset), zeros.read
    assert ids(x) == [idx_of(first)]*8 and [dl.vocab[int(o)] for o in plain(y)] == [str(idx_of(first))]*8
    x = plain(x)
    if split == 'valid': assert all(torch.equal(o, x[0]) for o in x)  # no augmentation on valid
    else:  # the same image, flipped or not: FlipItem runs per sample (seed 0 flips some and not others here)
        flipped = [bool(plain(o)[2, 0, -1] > 0) for o in x]
        assert any(flipped) and not all(flipped), flipped
    # fastai's own order again: valid in dataset order, train a permutation of the training items
    got = [i for b in order(dl) for i in b]
    want = [idx_of(f) for f in dl.items]
    if split == 'valid': assert got == want
    else: assert len(set(got)) == len(got) == len(dl)*dl.bs and set(got) <= set(want)

@pytest.mark.parametrize('split', ['valid', 'train'])
def test_show_batch_unique(items, split):
    "fastai's own `show_batch(unique=True)` on both splits, as fastbook uses it; fastai's `get_idxs` is restored"
    import matplotlib; matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    dl = getattr(dls_of(items, bs=4, seed=0), split)
    run_with_timeout(lambda: dl.show_batch(unique=True, max_n=4), 60)
    plt.close('all')
    assert 'get_idxs' not in vars(dl) or getattr(dl.get_idxs, '__func__', None) is type(dl).get_idxs
    xs,ys = dl.show_batch(unique=True, show=False)[:2]
    assert len(ys) == 4 and len({int(o) for o in ys}) == 1  # one item, shown 4 times

def test_custom_order_honoured(items):
    "A `get_idxs` installed by a callback (here: items in reverse, then every other one) is the order DALI reads"
    dls = dls_of(items, bs=3)
    dl = dls.valid
    n = len(dl.dataset)
    dl.get_idxs = lambda: list(reversed(range(n)))
    assert [i for b in order(dl) for i in b] == [idx_of(f) for f in reversed(dl.items)]
    dl.get_idxs = lambda: list(range(0, n, 2))  # fewer items than the dataset: only those, once
    assert [i for b in order(dl) for i in b] == [idx_of(dl.items[i]) for i in range(0, n, 2)]
    del dl.get_idxs
    assert [i for b in order(dl) for i in b] == [idx_of(f) for f in dl.items]

# ------------------------------------------------------------------------------------------------ seeds
@pytest.mark.parametrize('source', ['files', 'bytes'])
def test_seed_decides_the_order(items, source):
    "`set_seed(n)` before building: the same training orders (two epochs); another seed: other orders"
    get_x = (lambda f: Path(f).read_bytes()) if source == 'bytes' else None
    def run(s):
        set_seed(s)
        return order(dls_of(items, get_x=get_x, bs=5).train, epochs=2)
    a,b,c = run(7), run(12345), run(7)
    assert a == c
    assert a != b and a[:len(a)//2] != b[:len(b)//2]  # differ in the first epoch already
    assert a[:len(a)//2] != a[len(a)//2:]  # and each epoch is a new permutation
    train = sorted(idx_of(f) for f in items if not is_valid(f))
    for o in (a, b):  # drop_last: full batches of distinct training items, in each epoch
        ep = [i for batch in o[:len(o)//2] for i in batch]
        assert len(set(ep)) == len(ep) and set(ep) <= set(train) and len(ep) == len(train)//5*5

def test_seed_argument(items):
    "`seed=` given to the factory: the same seed, the same order; a different one, a different order"
    o = lambda s: order(dls_of(items, bs=5, seed=s).train)
    assert o(1) == o(1) and o(1) != o(2)

def test_masks_follow_shuffled_images(items):
    "Masks are read by a second reader that shuffles in lock-step with the images, whatever the seed"
    codes = [str(i) for i in range(256)]
    dblock = DataBlock(blocks=(ImageBlock, MaskBlock(codes=codes)), get_items=lambda _: items,
                       get_y=lambda f: f.parent/f'{f.stem}_m.png', splitter=FuncSplitter(is_valid))
    for s in (3, 4):
        dls = DaliDataLoaders.from_dblock(dblock, None, device=DEVICE, num_threads=1, bs=4, seed=s)
        for x,m in dls.train:
            assert ids(x) == plain(m)[:, 0, 0].long().tolist()

def test_dali_report_with_endless_get_idxs(items):
    "`dali_report` builds the pipeline too: with an endless `get_idxs` it reads it lazily as iteration does"
    dl = dls_of(items, bs=4).valid.new(get_idxs=lambda: Inf.zeros, shuffle=False)
    rep = run_with_timeout(dl.dali_report, 60)
    assert 'IntToFloatTensor' in list(rep['transform'])

def test_short_custom_order_drop_last(items):
    "A replaced `get_idxs` with fewer items on a drop_last loader: only full batches, as fastai gives"
    dl = dls_of(items, bs=5).train
    assert dl.drop_last
    dl.get_idxs = lambda: [0, 1, 2, 4, 5, 6, 8]  # 7 items: one full batch
    assert order(dl) == [[idx_of(dl.items[i]) for i in (0, 1, 2, 4, 5)]]

@pytest.mark.parametrize('seed', [None, 11])
def test_shards_share_the_permutation(items, seed):
    "Shards shuffle one permutation between them, also when each loader draws its own seed (none given), and when one rebuilds alone"
    dblock = DataBlock(blocks=(ImageBlock, CategoryBlock(vocab=[str(i) for i in range(N)])), get_items=lambda _: items,
                       get_y=lambda f: str(idx_of(f)), splitter=FuncSplitter(is_valid))
    shards = [DaliDataLoaders.from_dblock(dblock, None, device=DEVICE, num_threads=1, bs=3, drop_last=False, seed=seed,
                                          shard_id=s, num_shards=2) for s in range(2)]
    shards[0].train.one_batch()  # an abandoned epoch: shard 0 rebuilds, shard 1 does not
    train = sorted(idx_of(f) for f in items if not is_valid(f))
    for ep in range(3):
        # and again mid-training, on the other shard: with a given seed (as a distributed run has: rank 0's) the shards
        # stay in step; with none each would fall back to DALI's fixed permutation of its own first epoch
        if ep == 1 and seed is not None: shards[1].train.one_batch()
        got = [i for d in shards for b in order(d.train) for i in b]
        assert sorted(set(got)) == train and len(got) == len(train) + len(train) % 2, got  # 2 shards: 1 item repeated at most

"""Every `ImageDataLoaders` factory, through `DaliDataLoaders`, against fastai's own on the same generated images.

Checked for each factory (`from_path_func`, `from_name_func`, `from_path_re`, `from_name_re`, `from_df`, `from_csv`,
`from_lists`, `from_dblock`, `DataBlock.dali_dataloaders`): vocab, the valid items in order, the train items as a set,
the valid targets of one epoch in order, `len(dl)` of both loaders, and the types, dtypes and shapes of a batch.
Then multi-label (`label_delim`) and regression (`RegressionBlock`) targets with a short training run each, labels
staying with their images under shuffling (each class a solid colour: the class is read back from the pixels), and
errors (a class only in valid, a missing file).

pandas 3: fastai's `ColReader` with integer column positions (the default `fn_col=0, label_col=1`) fails for both
loaders, so the DataFrame factories get column names.
"""
import copy, os
from functools import partial
from pathlib import Path

import numpy as np, pandas as pd, pytest, torch
import matplotlib; matplotlib.use('Agg')
import matplotlib.pyplot as plt

from fastai.vision.all import (ImageDataLoaders, DataBlock, ImageBlock, CategoryBlock, RegressionBlock, ColReader,
                                ColSplitter, GrandparentSplitter, RandomSplitter, Resize, get_image_files,
                                parent_label, set_seed, vision_learner, resnet18, accuracy_multi, MSELossFlat,
                                TensorMultiCategory, TensorImage)
from fastai_dali.data import DaliDataLoaders   # also patches `DataBlock.dali_dataloaders`
from fastai_dali.loader import DaliDL
from fastai_dali.errors import DaliReadError

from conftest import CLASSES, gpu_keeps, make_noise_folder, plain, save_jpeg

DEVICE = os.environ.get('FASTAI_DALI_TEST_DEVICE', 'cpu')   # as in test_parity.py
N_TRAIN, N_VALID, BS = 24, 12, 5                            # 36 images: len(dl)s with remainders for every split
TFM = Resize(32)


# ---------------------------------------------------------------------------------------------- helpers

def valid_targets(dl): return torch.cat([plain(y) for _,y in dl])

def keys(items):
    "Comparable keys of a dataset's items: paths, (path, label) tuples, or DataFrame rows with their index"
    if isinstance(items, pd.DataFrame):
        return [(str(i),) + tuple(map(str, r)) for i,r in zip(items.index, items.itertuples(index=False))]
    return [tuple(map(str, o)) if isinstance(o, tuple) else str(o) for o in items]

def batch_sig(b):
    "(type, dtype, shape) of each part of a batch"
    return [(type(o), o.dtype, tuple(o.shape)) for o in b]

def check_parity(dd, fd, n_valid=None):
    "Vocab, split, valid order, valid targets, lengths and batch types of `dd` (DALI) equal to fastai's `fd`"
    assert type(dd) is DaliDataLoaders and isinstance(dd.train, DaliDL) and isinstance(dd.valid, DaliDL)
    dv,fv = getattr(dd, 'vocab', None),getattr(fd, 'vocab', None)   # regression targets have no vocab
    assert (dv is None) == (fv is None) and (dv is None or list(dv) == list(fv))
    assert keys(dd.valid.items) == keys(fd.valid.items)
    assert sorted(keys(dd.train.items)) == sorted(keys(fd.train.items))
    if n_valid is not None: assert len(dd.valid_ds) == n_valid
    assert (len(dd.train), len(dd.valid)) == (len(fd.train), len(fd.valid))
    assert len(dd.train) >= 1 and len(dd.valid) >= 1
    dy,fy = valid_targets(dd.valid),valid_targets(fd.valid)
    assert dy.dtype == fy.dtype and torch.equal(dy, fy)
    for dl,fl in ((dd.train, fd.train), (dd.valid, fd.valid)):
        db,fb = dl.one_batch(),fl.one_batch()
        assert batch_sig(db) == batch_sig(fb)
        assert type(db[0]) is TensorImage and db[0].dtype == torch.float32 and db[0].shape[1:] == (3, 32, 32)
    return dy

def both(factory, *args, **kwargs):
    "The DALI loaders and fastai's from the same factory and arguments"
    dd = getattr(DaliDataLoaders, factory)(*args, device=DEVICE, **copy.deepcopy(kwargs))
    fd = getattr(ImageDataLoaders, factory)(*args, device='cpu', num_workers=0, **copy.deepcopy(kwargs))
    return dd, fd


# ------------------------------------------------------------------------------------------------ data
@pytest.fixture(scope='module')
def root(tmp_path_factory):
    "ImageNet-style folder of photo crops, 40..120 px: 24 train + 12 valid, classes cat/dog/fish"
    return make_noise_folder(tmp_path_factory.mktemp('factories'), N_TRAIN, N_VALID, seed=11, hi=120)

@pytest.fixture(scope='module')
def fnames(root): return get_image_files(root)

def _tags(i, p):
    "Multi-label tags of item `i`: its class plus 'big'/'small', and 'striped' on every third"
    return ' '.join(sorted({parent_label(p), 'big' if i % 2 else 'small'} | ({'striped'} if i % 3 == 0 else set())))

@pytest.fixture(scope='module')
def df(root, fnames):
    "One row per image: relative file name, class, tags, a float score, is_valid; a shuffled, non-range index"
    d = pd.DataFrame({'fname': [str(p.relative_to(root)) for p in fnames],
                      'label': [parent_label(p) for p in fnames],
                      'tags': [_tags(i, p) for i,p in enumerate(fnames)],
                      'score': [float((i*7) % 11)/3 for i in range(len(fnames))],
                      'is_valid': [p.parent.parent.name == 'valid' for p in fnames]},
                     index=[f'id{i:02d}' for i in range(len(fnames))])
    return d.sample(frac=1, random_state=0)


# ------------------------------------------------------------------------------------- 1. every factory
def _name_label(name): return name.split('_')[0]
def _is_cat(name): return name.startswith('c')        # fastai's pets tutorial style: boolean labels

def _case(name, root, fnames, df):
    "(factory, args, kwargs, expected valid labels as a function of a valid item) for case `name`"
    common = dict(item_tfms=TFM, bs=BS)
    pct = dict(valid_pct=0.25, seed=42)
    cols = dict(fn_col='fname', label_col='label')
    if name == 'path_func':   return 'from_path_func', (root, fnames, parent_label), {**pct, **common}
    if name == 'name_func':   return 'from_name_func', (root, fnames, _name_label), {**pct, **common}
    if name == 'name_func_bool': return 'from_name_func', (root, fnames, _is_cat), {**pct, **common}
    if name == 'path_re':     return 'from_path_re', (root, fnames, r'/([^/]+)/[^/]+\.jpg$'), {**pct, **common}
    if name == 'name_re':     return 'from_name_re', (root, fnames, r'^([a-z]+)_\w+_\d+\.jpg$'), {**pct, **common}
    if name == 'df_pct':      return 'from_df', (df, root), {**cols, **pct, **common}
    if name == 'df_valid_col': return 'from_df', (df, root), {**cols, 'valid_col': 'is_valid', **common, 'val_bs': 4}
    if name == 'df_folder_suff':
        tr = df[~df.is_valid].copy()
        tr['fname'] = [f[len('train/'):-len('.jpg')] for f in tr.fname]   # 'cat/cat_train_000'
        return 'from_df', (tr, root), {**cols, 'folder': 'train', 'suff': '.jpg', **pct, **common}
    if name == 'csv':
        csv = root/'labels_factories.csv'
        df.to_csv(csv, index=False)
        return 'from_csv', (root, csv.name), {**cols, 'valid_col': 'is_valid', 'delimiter': ',', **common}
    if name == 'lists':       return 'from_lists', (root, fnames, [parent_label(p) for p in fnames]), {**pct, **common}
    if name == 'lists_multi':  # lists of labels: fastai picks MultiCategoryBlock
        labels = [[parent_label(p), 'big' if i % 2 else 'small'] for i,p in enumerate(fnames)]
        return 'from_lists', (root, fnames, labels), {**pct, **common}
    if name == 'lists_float':  # float labels: fastai picks RegressionBlock
        return 'from_lists', (root, fnames, [float(len(p.stem) % 5) for p in fnames]), {**pct, **common}
    raise KeyError(name)

FACTORY_CASES = ['path_func', 'name_func', 'name_func_bool', 'path_re', 'name_re', 'df_pct', 'df_valid_col',
                 'df_folder_suff', 'csv', 'lists', 'lists_multi', 'lists_float']

# on the GPU: a category, a boolean, a data frame with its own valid batch size, multi-hot and float targets
@pytest.mark.parametrize('name', gpu_keeps(FACTORY_CASES, 'path_func', 'name_func_bool', 'df_valid_col', 'lists_multi',
                                           'lists_float'))
def test_factory_parity(root, fnames, df, name):
    factory,args,kwargs = _case(name, root, fnames, df)
    dd,fd = both(factory, *args, **kwargs)
    n_valid = N_VALID if name in ('df_valid_col', 'csv') else None
    dy = check_parity(dd, fd, n_valid)
    if name in ('path_func', 'name_func', 'path_re', 'name_re'):
        assert list(dd.vocab) == sorted(CLASSES)
        assert dy.tolist() == [dd.vocab.o2i[parent_label(f)] for f in dd.valid.items]   # the true classes
    if name == 'name_func_bool':
        assert list(dd.vocab) == [False, True]
        assert dy.tolist() == [int(_is_cat(Path(f).name)) for f in dd.valid.items]
    if name == 'df_valid_col':
        assert dd.valid.bs == 4 and len(dd.valid) == 3
        assert set(dd.valid.items.fname) == set(df.fname[df.is_valid])
    if name == 'lists_multi':
        assert list(dd.vocab) == ['big', 'cat', 'dog', 'fish', 'small'] and type(dd.valid.one_batch()[1]) is TensorMultiCategory
    if name == 'lists_float':
        assert dy.dtype == torch.float32 and dy.tolist() == [o[1] for o in dd.valid.items]

def _dblock(kind, root):
    if kind == 'grandparent':
        return DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files, splitter=GrandparentSplitter(),
                         get_y=parent_label, item_tfms=TFM)
    if kind == 'random_name':
        return DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files,
                         splitter=RandomSplitter(0.3, seed=7), get_y=lambda p: _name_label(p.name), item_tfms=TFM)
    if kind == 'df_cols':
        return DataBlock(blocks=(ImageBlock, CategoryBlock), get_x=ColReader('fname', pref=f'{root}{os.sep}'),
                         get_y=ColReader('label'), splitter=ColSplitter('is_valid'), item_tfms=TFM)

# on the GPU: a folder through `from_dblock`, a data frame through the DataBlock's method
@pytest.mark.parametrize('kind,how', gpu_keeps([(k, h) for k in ('grandparent', 'random_name', 'df_cols')
                                                for h in ('from_dblock', 'method')],
                                               ('grandparent', 'from_dblock'), ('df_cols', 'method')))
def test_dblock_parity(root, df, kind, how):
    dblock,source = _dblock(kind, root),(df if kind == 'df_cols' else root)
    kw = dict(bs=BS, path=root)
    dd = (DaliDataLoaders.from_dblock(dblock, source, device=DEVICE, **kw) if how == 'from_dblock'
          else dblock.dali_dataloaders(source, device=DEVICE, **kw))
    fd = dblock.dataloaders(source, device='cpu', num_workers=0, **kw)
    dy = check_parity(dd, fd, N_VALID if kind != 'random_name' else None)
    assert dd.path == fd.path == root
    if kind == 'grandparent':
        assert all(Path(f).parent.parent.name == 'valid' for f in dd.valid.items)
        assert dy.tolist() == [dd.vocab.o2i[parent_label(f)] for f in dd.valid.items]


# --------------------------------------------------------------------------------------- 2. multi-label
@pytest.fixture(scope='module')
def multi(root, df):
    kw = dict(fn_col='fname', label_col='tags', label_delim=' ', valid_col='is_valid', item_tfms=TFM, bs=BS)
    return both('from_df', df, root, **kw)

def test_multilabel_targets(multi, df):
    dd,fd = multi
    dy = check_parity(dd, fd, N_VALID)
    assert list(dd.vocab) == ['big', 'cat', 'dog', 'fish', 'small', 'striped']
    x,y = dd.valid.one_batch()
    assert type(y) is TensorMultiCategory and y.dtype == torch.float32 and y.shape == (BS, 6)
    assert set(dy.unique().tolist()) == {0., 1.}
    # multi-hot of each valid row's tags, in row order
    exp = torch.tensor([[float(v in t.split(' ')) for v in dd.vocab] for t in dd.valid.items.tags])
    assert torch.equal(dy, exp)

def test_multilabel_show_batch(multi):
    dd,_ = multi
    plt.close('all')
    dd.show_batch(max_n=4)
    fig = plt.gcf()
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert len(titles) == 4 and all(set(t.split(';')) <= set(dd.vocab) for t in titles), titles
    plt.close(fig)

def test_multilabel_train_and_get_preds(multi):
    dd,fd = multi
    set_seed(0)
    learn = vision_learner(dd, resnet18, pretrained=False, metrics=partial(accuracy_multi, thresh=0.5))
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert np.isfinite(learn.recorder.values[-1]).all()
    preds,targs = learn.get_preds()
    assert preds.shape == (N_VALID, len(dd.vocab)) and ((0 <= preds) & (preds <= 1)).all()   # sigmoid
    assert torch.equal(plain(targs), valid_targets(fd.valid))


# ---------------------------------------------------------------------------------------- 3. regression
@pytest.fixture(scope='module')
def regression(root, df):
    kw = dict(fn_col='fname', label_col='score', y_block=RegressionBlock, valid_col='is_valid', item_tfms=TFM, bs=BS)
    return both('from_df', df, root, **kw)

def test_regression_targets(regression):
    dd,fd = regression
    dy = check_parity(dd, fd, N_VALID)
    x,y = dd.valid.one_batch()
    assert y.dtype == torch.float32 and y.shape == (BS,)
    assert torch.allclose(dy, torch.tensor(list(dd.valid.items.score), dtype=torch.float32))

def test_regression_train(regression):
    dd,fd = regression
    set_seed(0)
    learn = vision_learner(dd, resnet18, n_out=1, loss_func=MSELossFlat(), pretrained=False)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert np.isfinite(learn.recorder.values[-1]).all()
    preds,targs = learn.get_preds()
    assert preds.shape == (N_VALID, 1)
    assert torch.equal(plain(targs), valid_targets(fd.valid))


# ------------------------------------------------------------- 4. labels stay with their images in training
PALETTE = {'red': (220, 35, 35), 'green': (35, 190, 35), 'blue': (35, 35, 220), 'yellow': (215, 215, 40)}

@pytest.fixture(scope='module')
def colour_folder(tmp_path_factory):
    "A flat folder of solid-colour JPEGs (+-20 noise, 40..120 px); file names (shuffled ids) do not give the class"
    root,rng = tmp_path_factory.mktemp('colours'),np.random.default_rng(5)
    n = 34
    ids,labels = rng.permutation(n),{}
    for k in range(n):
        c = list(PALETTE)[k % len(PALETTE)]
        h,w = (int(o) for o in rng.integers(40, 121, size=2))
        img = np.clip(np.array(PALETTE[c]) + rng.integers(-20, 21, size=(h, w, 3)), 0, 255).astype(np.uint8)
        name = f'img_{ids[k]:03d}.jpg'
        save_jpeg(img, root/name)
        labels[name] = c
    return root, labels

def colour_of(x):
    "The palette colour nearest each image's mean colour (x: 0..1 floats, N,3,H,W)"
    pal = torch.tensor(list(PALETTE.values()), dtype=torch.float32) / 255
    d = torch.cdist(plain(x).float().mean((2, 3)), pal)
    assert (d.min(1).values < 0.12).all(), d.min(1).values   # an unambiguous match
    return [list(PALETTE)[i] for i in d.argmin(1).tolist()]

@pytest.mark.parametrize('factory,bs', [('from_name_func', 6), ('from_lists', 5)])
def test_train_labels_follow_images(colour_folder, factory, bs):
    root,labels = colour_folder
    files = get_image_files(root)
    if factory == 'from_name_func': args = (root, files, labels.__getitem__)   # non-trivial: a lookup by name
    else: args = (root, files, [labels[f.name] for f in files])
    dd,fd = both(factory, *args, valid_pct=0.2, seed=3, item_tfms=TFM, bs=bs)
    n_train = len(dd.train_ds)
    assert n_train == 28 and len(dd.train) == n_train // bs == len(fd.train)
    vocab = list(dd.vocab)
    # the colour classifier itself, on fastai's images
    fx,fy = (torch.cat(o) for o in zip(*[(plain(x), plain(y)) for x,y in fd.valid]))
    assert colour_of(fx) == [vocab[i] for i in fy.tolist()]
    orders = []
    for e in range(2):
        seen = []
        for x,y in dd.train:
            assert len(y) == bs and x.shape == (bs, 3, 32, 32)
            got,want = colour_of(x),[vocab[i] for i in plain(y).tolist()]
            assert got == want, f"epoch {e}: labels {want} for images of colours {got}"
            seen += want
        assert len(seen) == len(dd.train)*bs
        if n_train % bs == 0:   # every train item exactly once: class counts are the dataset's
            assert sorted(seen) == sorted(labels[Path(f if isinstance(f, (str, Path)) else f[0]).name]
                                          for f in dd.train_ds.items)
        orders.append(seen)
    assert orders[0] != orders[1], "the same label order in both epochs: no shuffle"
    # and valid: every item in order, labelled with its colour
    dx,dy = (torch.cat(o) for o in zip(*[(plain(x), plain(y)) for x,y in dd.valid]))
    assert colour_of(dx) == [vocab[i] for i in dy.tolist()] and torch.equal(dy, fy)


# ----------------------------------------------------------------------------------------------- 5. errors
def test_label_only_in_valid_path_func(root, fnames):
    "A label function giving one valid item a class train lacks: ValueError at construction, naming the class"
    _,va = RandomSplitter(0.25, seed=42)(fnames)
    odd = fnames[va[2]]
    def label(p): return 'zebra' if p == odd else parent_label(p)
    with pytest.raises(ValueError, match='zebra') as ei:
        DaliDataLoaders.from_path_func(root, fnames, label, valid_pct=0.25, seed=42, item_tfms=TFM, bs=BS, device=DEVICE)
    assert str(odd) in str(ei.value)
    # fastai itself only fails when the item is loaded
    fd = ImageDataLoaders.from_path_func(root, fnames, label, valid_pct=0.25, seed=42, item_tfms=TFM, bs=BS,
                                         device='cpu', num_workers=0)
    with pytest.raises(KeyError, match='zebra'): list(fd.valid)

def test_label_only_in_valid_multilabel(root, df):
    d = df.copy()
    i = d.index[d.is_valid][3]
    d.loc[i, 'tags'] = d.loc[i, 'tags'] + ' zebra'
    with pytest.raises(ValueError, match='zebra'):
        DaliDataLoaders.from_df(d, root, fn_col='fname', label_col='tags', label_delim=' ', valid_col='is_valid',
                                item_tfms=TFM, bs=BS, device=DEVICE)

def test_label_only_in_valid_lists(root, fnames):
    _,va = RandomSplitter(0.25, seed=42)(fnames)
    labels = [parent_label(p) for p in fnames]
    labels[va[0]] = 'zebra'
    with pytest.raises(ValueError, match='zebra'):
        DaliDataLoaders.from_lists(root, fnames, labels, valid_pct=0.25, seed=42, item_tfms=TFM, bs=BS, device=DEVICE)

def test_df_missing_file(root, df):
    "A row whose file does not exist: iterating its loader raises an error naming the file, again on retry"
    d = df.copy()
    valid_rows = d.index[d.is_valid]
    d.loc[valid_rows[5], 'fname'] = 'valid/cat/not_there.jpg'   # not the first valid item
    missing = f'{root}{os.sep}valid/cat/not_there.jpg'
    dd = DaliDataLoaders.from_df(d, root, fn_col='fname', label_col='label', valid_col='is_valid', item_tfms=TFM,
                                 bs=BS, device=DEVICE)
    for _ in range(2):
        with pytest.raises((DaliReadError, FileNotFoundError)) as ei: list(dd.valid)
        assert str(Path(missing)) in str(ei.value) or missing in str(ei.value), str(ei.value)
    # fastai's error, for reference, names it too
    fd = ImageDataLoaders.from_df(d, root, fn_col='fname', label_col='label', valid_col='is_valid', item_tfms=TFM,
                                  bs=BS, device='cpu', num_workers=0)
    with pytest.raises(FileNotFoundError, match='not_there'): list(fd.valid)
    # the train loader, which does not hold the missing file, still works
    assert len(list(dd.train)) == len(dd.train) == len(fd.train)

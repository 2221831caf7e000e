"""Lifecycle: `get_preds` exactly once, pipelines reused, `tta`, errors in user code, round trips.
(Abandoned epochs, `lr_find` and a long run, with the checks that nothing accumulates: `test_abandoned_epochs.py`.)

Items are tiny lossless PNGs of one solid colour that encodes the item's id (red = id % 256, green = id // 256), and an
item's class is `CLASSES[id % 3]`, so every delivered sample says which item it is (its pixels) and which label it
must carry. Resizing a solid image keeps its colour exactly, so the ids are read back exactly; a sample whose pixels
are not all one colour (a blend of several items) fails the decoding. `IdNet` is a tiny trainable classifier whose
last output column is the id its input encodes, so `get_preds` shows which item each prediction belongs to.

What each group asserts (numbers measured on the 2-core CPU machine this was written on, DALI 2.4 CPU backend):
- `get_preds(dl=dls.valid)`, `get_preds(ds_idx=0)` and `get_preds(dl=dls.test_dl(files))` (a permuted list with a
  duplicate, not a multiple of bs): one prediction per item, in item order; targets = the items' labels; the same
  through the `get_x`-returns-bytes path (external_source, in process). A second call builds no pipeline (the loaders
  fastai makes share theirs); a loader of fewer items (`n`) gets its own; `tta`'s augmented
  passes draw different augmentations.
- Errors raised by user code: a `get_x` (bytes path, in process and in 2 worker processes) and an item transform that
  DALI cannot translate (runs in `fn.python_function`) raising `ValueError('boom')` for one item: iterating raises,
  within a timeout, an exception whose text (message and chained tracebacks) names 'boom' and the function; a second
  try raises again (no hang, no stale pipeline); the other split still works.
- Round trips: `export` -> `load_learner` -> `predict` and `get_preds(dl=test_dl(files))` with the files copied to a
  new path (the old one deleted), on the loaded learner's own loaders (fastai's: PIL) and on `DaliDataLoaders.from_dls` of
  them (DALI's again); pickling a `DaliDataLoaders`; two `DaliDataLoaders` iterated interleaved. (Loading where fastai_dali
  cannot be imported: test_export.py.)
- Collections in DALI's threads: a full collection forced inside an untranslated item transform (which DALI calls in
  the pipeline's own threads) finds its dropped loader. The process goes on (exit status 0; DALI would abort it:
  'Resource deadlock avoided'), the pipeline is kept until the next build, which shuts it down.
"""
import pickle, shutil
from pathlib import Path

import numpy as np, pytest, torch
from fastai.vision.all import (Resize, Learner, Transform, PILImage, load_learner, vision_learner, resnet18, set_seed,
                               Flip, Brightness, TfmdDL)
from fastai_dali.data import DaliDataLoaders
from fastai_dali.loader import DaliDL
from fastai_dali.errors import DaliPythonError, DaliReadError

from conftest import make_noise_folder, VALID0, make_id_folder, id_of, ids_of, IdNet, IdLoss
from conftest import DEVICE, PRED_ATOL, FASTAI_PRED_ATOL, gpu_keeps, plain, run_with_timeout
from conftest import (N_VALID, BS, bytes_block, id_loaders, labels_of, check_batch, check_train_epoch,
                      check_valid_epoch, exc_text)

pytestmark = pytest.mark.usefixtures('hang_guard')  # a hang ends the run with every thread's traceback

# ------------------------------------------------------------------------------------ 1. get_preds exactly once
@pytest.mark.parametrize('kind', ['files', 'bytes'])
def test_get_preds_exactly_once(id_root, kind):
    dls = id_loaders(id_root, kind)
    learn = Learner(dls, IdNet(), loss_func=IdLoss())
    valid = [id_of(f) for f in dls.valid_ds.items]
    preds,targs = learn.get_preds(dl=dls.valid)
    assert preds.shape == (N_VALID, 4)
    assert preds[:, -1].long().tolist() == valid                       # one prediction per item, in item order
    assert plain(targs).tolist() == labels_of(dls, valid)
    # the train split, unshuffled and without drop_last: every item once, in item order
    train = [id_of(f) for f in dls.train_ds.items]
    preds,targs = learn.get_preds(ds_idx=0)
    assert preds[:, -1].long().tolist() == train and plain(targs).tolist() == labels_of(dls, train)
    # a test set: permuted items of both splits, one twice, 17 items (not a multiple of bs)
    items = list(dls.valid_ds.items) + list(dls.train_ds.items)
    order = [21, 3, 40, 0, 7, 7, 60, 12, 55, 1, 30, 22, 64, 9, 18, 44, 5]
    files = [items[i] for i in order]
    want = [id_of(f) for f in files]
    tdl = dls.test_dl(files)
    assert isinstance(tdl, DaliDL)
    preds,targs = learn.get_preds(dl=tdl)
    assert targs is None and preds[:, -1].long().tolist() == want
    inp,preds,targs = learn.get_preds(dl=dls.test_dl(files, with_labels=True), with_input=True)
    assert ids_of(inp) == want and preds[:, -1].long().tolist() == want
    assert plain(targs).tolist() == labels_of(dls, want)
    # twice in a row, the second from a fresh loader: the same
    assert learn.get_preds(dl=dls.valid)[0][:, -1].long().tolist() == valid


def test_get_preds_reuses_its_pipeline(id_root):
    "fastai's `get_preds` makes new loaders at every call: the second call runs on the pipeline the first one built"
    dls = id_loaders(id_root)
    learn = Learner(dls, IdNet(), loss_func=IdLoss())
    valid = [id_of(f) for f in dls.valid_ds.items]
    assert dls.train.pipelines is dls.valid.pipelines   # fastai makes the valid loader with `new` too
    p1,_ = learn.get_preds()
    built = dls.valid.pipelines.n_builds
    for _ in range(3):
        p2,t2 = learn.get_preds()
        assert p2[:, -1].long().tolist() == valid and plain(t2).tolist() == labels_of(dls, valid)
    assert dls.valid.pipelines.n_builds == built and torch.equal(p1, p2)
    # the other split's, then this one again: one new pipeline, for the train split
    learn.get_preds(ds_idx=0); learn.get_preds(ds_idx=0); learn.get_preds()
    assert dls.valid.pipelines.n_builds == built + 1
    # kept pipelines are bounded: many different orders (a callback's, `show_batch(unique=True)`'s) keep at most `size`
    # (and each is built with a seed of its own: the same seed would repeat the augmentations of the one before)
    seeds = []
    for k in range(6):
        dls.valid.get_idxs = (lambda k: lambda: list(range(k, len(valid))))(k)
        assert check_batch(dls, dls.valid.one_batch(), set(valid)) == valid[k:k+BS]
        seeds.append(dls.valid.built.pipeline.seed)
    del dls.valid.get_idxs
    assert len(dls.valid.pipelines) <= dls.valid.pipelines.size and len(set(seeds)) == len(seeds), seeds
    check_valid_epoch(dls, list(dls.valid))
    # a loader of fewer items (`n`) gets a pipeline of its own, and the valid loader still reads all of them
    small = dls.valid.new(n=BS+1)
    assert [i for b in small for i in check_batch(dls, b, set(valid))] == valid[:BS+1]
    check_valid_epoch(dls, list(dls.valid))
    dls.valid.pipelines.clear()
    assert len(dls.valid.pipelines) == 0
    check_valid_epoch(dls, list(dls.valid))

def test_tta_passes_draw_their_own_augmentations(id_root):
    "`tta` runs `get_preds` on the augmented validation set `n` times: each pass draws its own augmentations, as fastai's"
    dls = DaliDataLoaders.from_folder(id_root, item_tfms=Resize(8), batch_tfms=[Flip(p=0.5), Brightness(max_lighting=0.4, p=1.)],
                                      bs=BS, device=DEVICE)
    learn = Learner(dls, IdNet(), loss_func=IdLoss())
    passes,get_preds = [],learn.get_preds
    def recording(*args, **kwargs):
        res = get_preds(*args, **kwargs); passes.append(res[0]); return res
    learn.get_preds = recording
    with learn.no_bar(): learn.tta(n=4)
    aug,plain_pass = passes[:4],passes[4]
    # the augmented passes: brightness moves the ids' pixels (-1: not the item's solid colour) differently each time
    assert all(not torch.equal(a, b) for i,a in enumerate(aug) for b in aug[i+1:])
    assert plain_pass[:, -1].long().tolist() == [id_of(f) for f in dls.valid_ds.items]


# ------------------------------------------------------------------------------------ 2. errors in user code
BAD = VALID0 + N_VALID - 2      # a valid item in the last batch: earlier batches are delivered first

def boom_get_x(f):
    if id_of(f) == BAD: raise ValueError('boom')
    return Path(f).read_bytes()

class BoomTfm(Transform):
    "An item transform with no DALI translation (it runs in fn.python_function) that fails on one image"
    order = 0
    def encodes(self, x:PILImage):
        a = np.asarray(x)
        if int(a[0, 0, 0]) + 256*int(a[0, 0, 1]) == BAD: raise ValueError('boom')
        return x

def _expect_boom(dl, func_name, timeout):
    "Iterating `dl` raises (within `timeout`) an error naming 'boom' and `func_name`; returns the batches before it"
    got = []
    def _run():
        for b in dl: got.append(b)
    with pytest.raises(Exception) as ei: run_with_timeout(_run, timeout)
    text = exc_text(ei.value)
    assert 'boom' in text and func_name in text, text[-3000:]
    # the user's error, not a file's: nothing is blamed on an image
    assert not isinstance(ei.value, DaliReadError), type(ei.value)
    return got, ei.value

# on the GPU in this process (the workers are CPU processes whichever device decodes, 12-25 s each to spawn there)
@pytest.mark.parametrize('py_workers', gpu_keeps([0, 2], 0))
def test_get_x_error_surfaces(id_root, py_workers):
    dls = bytes_block(get_x=boom_get_x).dali_dataloaders(id_root, bs=BS, device=DEVICE, py_workers=py_workers)
    timeout = 60 if py_workers == 0 else 240       # each pipeline build spawns the workers: 12..25 s here
    for _ in range(2):                              # and again: raises again, no hang, no stale pipeline
        got,_ = _expect_boom(dls.valid, 'boom_get_x', timeout)  # the user's own exception (type kept in-process)
        ids = [i for b in got for i in ids_of(b[0])]
        assert BAD not in ids and ids == [id_of(f) for f in dls.valid_ds.items][:len(ids)]
    if py_workers == 0:                             # the train split has no bad item: it still works
        check_train_epoch(dls, run_with_timeout(lambda: list(dls.train), 60))

def test_python_function_tfm_error_surfaces(id_root):
    dls = DaliDataLoaders.from_folder(id_root, item_tfms=[BoomTfm(), Resize(4)], bs=BS, device=DEVICE)
    rep = dls.valid.dali_report()
    assert list(rep[rep['transform'] == 'BoomTfm']['how']) == ['python'], rep
    for _ in range(2):
        got,e = _expect_boom(dls.valid, 'encodes', 60)
        assert isinstance(e, DaliPythonError), type(e)  # raised in fn.python_function: DALI wraps it, we name it
        ids = [i for b in got for i in ids_of(b[0])]
        assert BAD not in ids and ids == [id_of(f) for f in dls.valid_ds.items][:len(ids)]
    check_train_epoch(dls, run_with_timeout(lambda: list(dls.train), 60))


# ------------------------------------------------------------------------------------ 3. round trips
def test_export_load_learner_new_path(tmp_path):
    old = make_id_folder(tmp_path/'old')
    dls = id_loaders(old)
    learn = Learner(dls, IdNet(), loss_func=IdLoss())
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
    files_old = list(dls.valid_ds.items)[::-1] + list(dls.train_ds.items)[:5]
    ref,_ = learn.get_preds(dl=dls.test_dl(files_old))
    learn.export(tmp_path/'export.pkl')
    new = tmp_path/'new'
    shutil.copytree(old, new); shutil.rmtree(old)   # only the new path exists now
    learn2 = load_learner(tmp_path/'export.pkl')
    files = [new/Path(f).relative_to(old) for f in files_old]
    want = [id_of(f) for f in files]
    cls,idx,probs = learn2.predict(files[3])
    assert probs[-1].item() == want[3] and cls in dls.vocab and dls.vocab[idx] == cls
    assert torch.allclose(probs, ref[3], atol=1e-6)
    # fastai's own loaders (`DaliDataLoaders.new_empty`: what `load_learner` needs is fastai), and DALI's again: a solid
    # colour comes out of either resize exactly
    for d2,typ in ((learn2.dls, TfmdDL), (DaliDataLoaders.from_dls(learn2.dls), DaliDL)):
        tdl = d2.test_dl(files)
        assert type(tdl) is typ
        preds,_ = learn2.get_preds(dl=tdl)
        assert preds[:, -1].long().tolist() == want
        assert torch.allclose(preds, ref, atol=1e-6), (preds - ref).abs().max()
        preds,targs,dec = learn2.get_preds(dl=d2.test_dl(files, with_labels=True), with_decoded=True)
        assert preds[:, -1].long().tolist() == want and plain(targs).tolist() == labels_of(dls, want)
        assert torch.equal(dec, ref[:, :-1].argmax(-1))

def test_export_load_learner_new_path_resnet(tmp_path):
    "The same with a vision_learner on JPEGs: predictions at the new path equal the original ones"
    old = make_noise_folder(tmp_path/'old', 12, 9, seed=11)
    set_seed(0)
    dls = DaliDataLoaders.from_folder(old, item_tfms=Resize(32), bs=4, device=DEVICE)
    learn = vision_learner(dls, resnet18, pretrained=False)
    files_old = list(dls.valid_ds.items)[::-1]
    ref,_ = learn.get_preds(dl=dls.test_dl(files_old))
    learn.export(tmp_path/'export.pkl')
    shutil.copytree(old, tmp_path/'new'); shutil.rmtree(old)
    files = [tmp_path/'new'/Path(f).relative_to(old) for f in files_old]
    # load_learner puts the learner on the CPU by default: with a GPU, that changes the JPEG decoder (nvJPEG ->
    # libjpeg-turbo, a few levels) and the convolutions; measured on the H200: max |d| 5e-4 on the probabilities
    for cpu in ([True] if DEVICE == 'cpu' else [False, True]):
        learn2 = load_learner(tmp_path/'export.pkl', cpu=cpu)
        # its own loaders are fastai's (PIL): DALI's predictions up to the pixel parity
        preds,_ = learn2.get_preds(dl=learn2.dls.test_dl(files))
        assert preds.shape == ref.shape and torch.allclose(preds.cpu(), ref.cpu(), atol=FASTAI_PRED_ATOL), (cpu, (preds.cpu() - ref.cpu()).abs().max())
        learn2.dls = DaliDataLoaders.from_dls(learn2.dls)   # DALI's again
        atol = 1e-5 if DEVICE == 'cpu' or not cpu else 2e-3
        preds,_ = learn2.get_preds(dl=learn2.dls.test_dl(files))
        assert preds.shape == ref.shape and torch.allclose(preds.cpu(), ref.cpu(), atol=atol), (cpu, (preds.cpu() - ref.cpu()).abs().max())
        _,_,probs = learn2.predict(files[2])   # bs 1 vs 4: same images (test_parity.py's PRED_ATOL: batch size changes GPU kernels)
        assert torch.allclose(probs.cpu(), ref[2].cpu(), atol=max(atol, PRED_ATOL)), (cpu, (probs.cpu() - ref[2].cpu()).abs().max())

@pytest.mark.parametrize('kind', ['files', 'bytes'])
def test_pickle_dataloaders(id_root, kind):
    dls = id_loaders(id_root, kind)
    ref = [tuple(plain(o) for o in b) for b in dls.valid]   # built before pickling: the pipeline is not pickled
    dls2 = pickle.loads(pickle.dumps(dls))
    assert type(dls2) is DaliDataLoaders and dls2.valid is not dls.valid
    got = [tuple(plain(o) for o in b) for b in dls2.valid]
    assert len(got) == len(ref) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a,b in zip(got, ref))
    check_valid_epoch(dls2, got)
    check_train_epoch(dls2, list(dls2.train))
    check_valid_epoch(dls, list(dls.valid))           # the original still works

def test_two_dataloaders_interleaved(tmp_path, id_root):
    a = id_loaders(id_root)
    b = id_loaders(make_id_folder(tmp_path/'b', 31, 13, start=1000), bs=4)
    tra,trb = {id_of(f) for f in a.train_ds.items},{id_of(f) for f in b.train_ds.items}
    for _ in range(2):
        # both train loaders in lock-step; zip abandons the longer one's epoch
        n = 0
        for ba,bb in zip(a.train, b.train): check_batch(a, ba, tra, BS); check_batch(b, bb, trb, 4); n += 1
        assert n == min(len(a.train), len(b.train))
        # then whole epochs of all four loaders at once, interleaved batch by batch
        its = {k: iter(dl) for k,dl in (('ta', a.train), ('tb', b.train), ('va', a.valid), ('vb', b.valid))}
        got = {k: [] for k in its}
        while its:
            for k in list(its):
                try: got[k].append(next(its[k]))
                except StopIteration: del its[k]
        check_train_epoch(a, got['ta']); check_train_epoch(b, got['tb'])
        check_valid_epoch(a, got['va']); check_valid_epoch(b, got['vb'])
        assert all(i < 1000 for bt in got['ta'] for i in ids_of(bt[0]))
        assert all(i >= 1000 for bt in got['tb'] for i in ids_of(bt[0]))


def test_second_pass_while_first_alive(id_root):
    "A Python source iterated again while an earlier pass is still alive (e.g. `one_batch` inside a loop): the earlier pass keeps its own epoch"
    dls = id_loaders(id_root, 'bytes', num_threads=1)
    tr = {id_of(f) for f in dls.train_ds.items}
    g1 = iter(dls.train)
    first = next(g1)
    check_batch(dls, dls.train.one_batch(), tr, BS)
    check_train_epoch(dls, [first] + list(g1))  # one permutation: full, distinct batches
    check_train_epoch(dls, list(dls.train))


def test_dropped_loaders_pipelines_go_after_a_gpu_build(id_root):
    """A dropped DaliDataLoaders is cyclic garbage (a fastai `DataLoader` refers to itself through `fake_l`): once a
    pipeline is built on the GPU, its pipelines are collected, so their GPU memory and hardware JPEG decoders go. On
    DALI's CPU backend the build leaves them to Python's collector"""
    import gc, weakref
    gc.collect()
    gc.disable()  # as in a large process, where full collections are rare
    try:
        dls = id_loaders(id_root)
        dls.train.one_batch(); dls.valid.one_batch()
        dropped = [weakref.ref(b.pipeline) for b in (dls.train.built, dls.valid.built)]
        del dls
        assert all(w() is not None for w in dropped), "dropped loaders should be cyclic garbage here"
        dls2 = id_loaders(id_root)
        check_batch(dls2, dls2.train.one_batch(), {id_of(f) for f in dls2.train_ds.items}, BS)
        assert [w() is None for w in dropped] == [DEVICE != 'cpu']*2
    finally: gc.enable()


# ------------------------------------------------------------------------------------ 4. collections in DALI's threads
COLLECTED_IN_DALI_THREAD = '''
import gc, itertools, sys, threading, time
from pathlib import Path
import numpy as np
from PIL import Image
from fastai.vision.all import Transform, PILImage, Resize
from fastai_dali.data import DaliDataLoaders
from fastai_dali.lifetime import _deferred
root, device = Path(sys.argv[1]), sys.argv[2]
rng = np.random.default_rng(0)
for split,n in (('train', 24), ('valid', 4)):
    for c in 'ab':
        (root/split/c).mkdir(parents=True)
        for i in range(n): Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root/split/c/f'{i}.png')
BS, PREFETCH, calls, once = 2, 2, itertools.count(), threading.Lock()
dropped, collected, taken = threading.Event(), threading.Event(), threading.Event()

class CollectOnceDropped(Transform):
    "No DALI translation: fn.python_function calls it in the pipeline's threads. Once its loader is dropped, a full collection there"
    order = 0
    def encodes(self, x:PILImage):
        # the first PREFETCH batches run while the iterator is built, the next ones once a batch was taken. Until one
        # was taken, the main thread may be waiting for this very batch (a build that runs a batch more ahead: on the
        # H200 this test took 84 s against 11 s on the CPU, a call holding the build for its 60 s wait), so a call waits
        # for the drop 1 s at most then; once a batch was taken, as long as the drop takes
        if next(calls) >= PREFETCH*BS:
            t = time.monotonic()
            while not dropped.wait(0.1):
                if time.monotonic() - t > (60 if taken.is_set() else 1): return x
            if once.acquire(blocking=False):
                gc.collect()    # finds the dropped loader, and with it the pipeline running this very call
                collected.set()
        return x

dls = DaliDataLoaders.from_folder(root, item_tfms=[CollectOnceDropped(), Resize(8)], bs=BS, device=device, prefetch=PREFETCH)
it = iter(dls.train); next(it); taken.set()
pid = id(dls.train.built.pipeline)
del it, dls
dropped.set()
assert collected.wait(60), "DALI ran no further batch"
assert [id(p) for p in _deferred] == [pid], (pid, _deferred)   # kept, alive
kept = _deferred[0]
dls = DaliDataLoaders.from_folder(root, item_tfms=Resize(8), bs=BS, device=device)
x,y = dls.train.one_batch()
assert x.shape == (BS, 3, 8, 8) and _deferred == [] and kept._pipe is None   # the next build shut it down, here
print('shut down at the next build')
'''

def test_loader_collected_in_its_pipelines_thread(tmp_path):
    """A collection in one of DALI's threads (forced in an untranslated item transform, which `fn.python_function` calls
    there) finds the dropped loader whose pipeline runs that call. DALI's own `Pipeline.__del__` would shut the pipeline
    down from its own thread: 'Resource deadlock avoided', the process aborts (a notebook's kernel dies). Here it
    is kept, the process goes on, and the next build shuts it down in the main thread. In a subprocess: an abort ends it"""
    import os, subprocess, sys
    script = tmp_path/'collect.py'; script.write_text(COLLECTED_IN_DALI_THREAD)
    r = subprocess.run([sys.executable, str(script), str(tmp_path/'data'), DEVICE], capture_output=True, text=True,
                       timeout=300, env={**os.environ, 'PYTHONWARNINGS': 'ignore'})
    assert r.returncode == 0 and r.stdout.strip().endswith('shut down at the next build'), r.stderr[-3000:]
    assert 'deadlock' not in r.stderr and 'Fatal Python error' not in r.stderr, r.stderr[-3000:]

"""The mixed path: a `get_x` that returns encoded bytes (here: members of a zip archive) runs per sample in DALI's
parallel `external_source` worker processes; decoding and transforms stay in DALI. Compared with fastai's own
loaders on the same `DataBlock`.

Each build of a pipeline with worker processes spawns them, and each imports torch and fastai (~13 s on the H200), so
the tests share one `DaliDataLoaders` (module fixture) whose train and valid pipelines are built at once, and reuse
them (`get_preds(dl=dd.valid)`, the callback file of `dd.valid`)."""
import gc, os, zipfile
import pytest, torch
from pathlib import Path
from fastai.vision.all import (DataBlock, ImageBlock, CategoryBlock, FuncSplitter, Resize, vision_learner, resnet18,
                               accuracy, Transform, get_image_files, parent_label, GrandparentSplitter)
from fastai_dali.data import ZipMember  # and DataBlock.dali_dataloaders
from conftest import make_noise_folder, build_at_once
from conftest import DEVICE, plain

def zip_names(p): return sorted(zipfile.ZipFile(p).namelist())
def label_of(n): return n.split('/')[1]
def is_valid(n): return n.startswith('valid')

@pytest.fixture(scope='module')
def zipped(tmp_path_factory):
    root = make_noise_folder(tmp_path_factory.mktemp('zip')/'data', 22, 9, seed=7)
    zpath = root.parent/'images.zip'
    with zipfile.ZipFile(zpath, 'w') as z:
        for f in sorted(root.rglob('*.jpg')): z.write(f, f.relative_to(root).as_posix())
    return zpath

def block(zpath, **kw):
    return DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=zip_names, get_x=ZipMember(zpath), get_y=label_of,
                     splitter=FuncSplitter(is_valid), item_tfms=Resize(32), **kw)

@pytest.fixture(scope='module')
def loaders(zipped):
    dd = block(zipped).dali_dataloaders(zipped, bs=4, device=DEVICE, py_workers=2)
    fd = block(zipped).dataloaders(zipped, bs=4, device='cpu', num_workers=0)
    build_at_once(dd.train, dd.valid)
    yield dd, fd
    for dl in dd.loaders: dl.feed.release()
    gc.collect()

def test_valid_matches_fastai(loaders):
    dd,fd = loaders
    assert dd.vocab == fd.vocab and list(dd.valid.items) == list(fd.valid.items)
    assert (len(dd.train), len(dd.valid)) == (len(fd.train), len(fd.valid))
    db,fb = list(dd.valid),list(fd.valid)
    assert [len(b[0]) for b in db] == [len(b[0]) for b in fb]   # the padded last batch is trimmed
    assert torch.equal(torch.cat([plain(b[1]) for b in db]), torch.cat([plain(b[1]) for b in fb]))
    x,f = torch.cat([plain(b[0]) for b in db]),torch.cat([plain(b[0]) for b in fb])
    assert (x-f).abs().mean().item()*255 < 4.5     # the default Crop path's tolerance (tests/test_parity.py)

def test_train_epochs_exactly_len_full_batches(loaders):
    dd,fd = loaders
    orders = []
    for _ in range(2):
        ys = [plain(b[1]) for b in dd.train]
        assert [len(y) for y in ys] == [dd.train.bs]*len(dd.train)
        orders.append(torch.cat(ys))
    counts = torch.bincount(torch.cat([plain(y) for _,y in fd.train.new(shuffle=False, drop_last=False)]), minlength=len(dd.vocab))
    for o in orders: assert (torch.bincount(o, minlength=len(dd.vocab)) <= counts).all()
    assert not torch.equal(orders[0], orders[1])    # a fresh permutation each epoch

def test_one_batch_then_full_epoch(loaders):
    dd,_ = loaders
    for _ in range(2): dd.valid.one_batch()
    assert sum(len(b[0]) for b in dd.valid) == len(dd.valid_ds)

def test_in_process_same_as_workers(zipped, loaders):
    dd,_ = loaders
    d0 = block(zipped).dali_dataloaders(zipped, bs=4, device=DEVICE, py_workers=0)
    a,b = list(d0.valid),list(dd.valid)
    assert all(torch.equal(plain(x[1]), plain(y[1])) and torch.equal(plain(x[0]), plain(y[0])) for x,y in zip(a,b))

def test_trains_a_few_steps(loaders):
    dd,_ = loaders
    learn = vision_learner(dd, resnet18, pretrained=False, metrics=accuracy)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)
    preds,targs = learn.get_preds(dl=dd.valid)    # the built pipeline (`get_preds()` would build and spawn anew)
    assert len(preds) == len(dd.valid_ds)
    assert torch.equal(plain(targs), torch.tensor([dd.vocab.o2i[label_of(n)] for n in dd.valid.items]))

class OpenZip:
    def __init__(self, path): self.zf = zipfile.ZipFile(path)
    def __call__(self, name): return self.zf.read(name)

def test_unpicklable_get_x_is_named(zipped):
    bad = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=zip_names, get_x=OpenZip(zipped), get_y=label_of,
                    splitter=FuncSplitter(is_valid), item_tfms=Resize(32))
    dls = bad.dali_dataloaders(zipped, bs=4, device=DEVICE, py_workers=2)
    with pytest.raises(TypeError, match='picklable'): dls.train.one_batch()

def test_worker_callback_file_removed(loaders):
    "The callback reaches the workers as a temp file (03_loader: they start at once); it goes with the pipeline"
    import os
    from fastai_dali.sources import EpochSource
    dd,_ = loaders
    assert sum(len(b[0]) for b in dd.valid) == len(dd.valid_ds)
    src = dd.valid.built.source
    assert isinstance(src, EpochSource) and src._fn is None   # read by the workers when they started, then deleted
    fn = src.__reduce__()[1][0]; assert os.path.exists(fn)    # pickled again: a new file, deleted with the source
    del src; dd.valid.feed.release(); gc.collect()    # (a later test using `loaders` would build it again)
    assert not os.path.exists(fn)

def _script(tmp_path, guarded):
    "A training-style script building a `get_x`-bytes loader (1 worker process) at its top level, or under a main guard"
    import textwrap
    body = textwrap.dedent(f'''
        path = make_image_folder(Path({str(tmp_path)!r})/'p', n_train=4, n_valid=2, classes=('coffee', 'rocket'))
        blk = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files, get_x=read, get_y=parent_label,
                        splitter=GrandparentSplitter(), item_tfms=Resize(16))
        dls = blk.dali_dataloaders(path, bs=2, device='cpu', py_workers=1)
        x,y = dls.one_batch()
        import multiprocessing
        print('batch', tuple(x.shape), 'workers', len(multiprocessing.active_children()))
        ''')
    head = textwrap.dedent('''
        from pathlib import Path
        from fastai.vision.all import *
        from fastai_dali.all import *
        from fastai_dali.samples import make_image_folder
        def read(f): return Path(f).read_bytes()
        ''')
    script = tmp_path/'train.py'
    script.write_text(head + ("if __name__ == '__main__':\n" + textwrap.indent(body, '    ') if guarded else body))
    return script

@pytest.mark.skipif(DEVICE != 'cpu', reason="how 'spawn' imports a script: a CPU loader's, CI runs this")
@pytest.mark.parametrize('guarded', [False, True])
def test_script_with_or_without_main_guard(tmp_path, guarded):
    "DALI's workers import the script ('spawn'): one that builds its loaders at the top level reads in its own process, and says how to get the workers; a guarded one gets them"
    import subprocess, sys
    r = subprocess.run([sys.executable, str(_script(tmp_path, guarded))], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == f"batch (2, 3, 16, 16) workers {1 if guarded else 0}", r.stdout
    told = "outside `if __name__ == '__main__':`" in r.stderr
    assert told != guarded, r.stderr[-3000:]


class _Box:   # (a `_PickledInFile` of the tests' own, as DALI's workers receive a source)
    def __init__(self, v): self.v = v

def _sigint_after_load(fn):
    import signal
    from fastai_dali.sources import _load_pickled
    return _load_pickled(fn).v, signal.getsignal(signal.SIGINT) == signal.SIG_IGN

def test_workers_leave_ctrl_c_to_the_main_process():
    "A worker process that loads its source ignores SIGINT (a notebook kernel's interrupt or shutdown signals its whole process group: each of DALI's workers printed a KeyboardInterrupt traceback); the main process keeps its handler"
    import multiprocessing, signal
    from fastai_dali.sources import _PickledInFile, _load_pickled
    box = type('Box', (_Box, _PickledInFile), {})(3)
    load,(fn,) = box.__reduce__()
    assert load is _load_pickled
    with multiprocessing.get_context('spawn').Pool(1) as pool: assert pool.apply(_sigint_after_load, (fn,)) == (3, True)
    # in the main process the handler is left as it was: whatever handler it has (an earlier test may have set another), a
    # handler of this test's own, put back after
    def mine(signum, frame): pass
    before = signal.signal(signal.SIGINT, mine)
    try: loaded,after = _load_pickled(fn),signal.getsignal(signal.SIGINT)
    finally: signal.signal(signal.SIGINT, before)
    assert loaded.v == 3 and after is mine, after

class ReadBytes(Transform):
    "A fastai `Transform` giving a file's bytes (typed: it goes to DALI's workers as fastai's pipeline)"
    def encodes(self, f:Path): return f.read_bytes()

def test_plain_get_x_workers_import_neither_torch_nor_fastai(tmp_path):
    "A `get_x` that is a plain function reaches DALI's workers as an `FnSource`: they unpickle it and read the items without importing torch or fastai (each took seconds with them), the bytes the file's; a typed fastai `Transform` still goes as fastai's pipeline (`PythonSource`)"
    import hashlib
    from fastai_dali.sources import FnSource, read_file_bytes
    from conftest import seen_by_a_worker
    from fastai_dali.items import PythonSource
    root = make_noise_folder(tmp_path/'data', 6, 3, seed=3)
    blk = lambda gx: DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files, get_x=gx, get_y=parent_label,
                               splitter=GrandparentSplitter(), item_tfms=Resize(8))
    dls = blk(read_file_bytes).dali_dataloaders(root, bs=2, device=DEVICE, py_workers=1)
    src = dls.train.dali_inputs().python
    assert type(src) is FnSource and src.fn is read_file_bytes, type(src)
    assert seen_by_a_worker(src, 5) == ['6', hashlib.md5(Path(dls.train.items[5]).read_bytes()).hexdigest(), 'False', 'False']
    typed = blk(ReadBytes()).dali_dataloaders(root, bs=2, device=DEVICE, py_workers=1).train.dali_inputs().python
    assert type(typed) is PythonSource, type(typed)
    assert bytes(typed[5]) == bytes(src[5])

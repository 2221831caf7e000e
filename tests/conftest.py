"""Shared fixtures for the parity tests: small ImageNet-style JPEG folders made from scikit-image photos.

Everything is generated under pytest's tmp dir (nothing goes into git). Images are random crops of the photos
bundled with scikit-image, 40..160 px on each side (so many aspect ratios), saved by PIL as JPEG quality 90.
Classes get items round-robin, so class sizes are uneven when `n` is not a multiple of the number of classes.
"""
import gc, os, threading, warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault('MPLBACKEND', 'Agg')

def own_share_of_cores():
    """In a run of N pytest-xdist processes (the GPU suite: 4 on 16 cores), this process keeps its own N-th of the cores,
    as a cluster scheduler gives each job its cores. What sizes itself by the cores a process may run on follows: DALI's
    `num_threads` and the Python workers by default (`default_num_threads`), and torch's threads, set up at its import
    (below). Sized for all the cores each, 4 processes would oversubscribe them 4 times. Returns the cores kept"""
    n,cores = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', 1)),sorted(os.sched_getaffinity(0))
    # a process this one starts (DALI's spawned Python workers, which import this module to unpickle a test's `get_x`;
    # torchrun ranks) inherits the share: it must not take a share of the share
    if n < 2 or len(cores) < n or os.environ.get('FASTAI_DALI_TEST_CORES'): return cores
    k = int(os.environ['PYTEST_XDIST_WORKER'].lstrip('gw')) % n
    mine = cores[k*len(cores)//n:(k+1)*len(cores)//n]  # contiguous, every core in some share
    os.sched_setaffinity(0, mine)
    os.environ['FASTAI_DALI_TEST_CORES'] = ','.join(map(str, mine))
    os.environ['FASTAI_DALI_RUN_CORES'] = ','.join(map(str, cores))   # (all of the run's: a test of a 2-core machine takes 2 of them)
    return mine

own_share_of_cores()
warnings.filterwarnings('ignore', message='.*torch.jit.script.*', category=FutureWarning)

import numpy as np, pytest, torch
from torch import nn
# the tests run what users import, in any order: `fastai_dali.all`, its patches of fastai applied (Patches); what importing
# a module alone changes is `test_import_changes.py`'s, in a fresh process
import fastai_dali.all
import torch.nn.functional as F
from PIL import Image

# The DALI side runs where FASTAI_DALI_TEST_DEVICE says: 'cpu' (CI, DALI's CPU backend) or 'cuda' (a GPU machine,
# GPU JPEG decode); fastai's side always runs on the CPU. Batches are compared on the CPU.
DEVICE = os.environ.get('FASTAI_DALI_TEST_DEVICE', 'cpu')

def is_sync_warning(w):
    "Whether warning `w` is `torch.cuda.set_sync_debug_mode('warn')` seeing a synchronizing call (not its own notice, given once a process the first time the mode is set, which names 'synchronizing operations' too)"
    m = str(w.message)
    return 'synchronizing' in m and 'prototype feature' not in m
# Same model, same image, loaded twice: on the GPU the JPEG decoder differs between batch sizes (nvJPEG's hardware
# decoder takes batches, its CUDA decoder single images) and from the CPU's; measured on an H200 <= 0.0015
PRED_ATOL = 1e-4 if DEVICE == 'cpu' else 5e-3
# Same model, same images, DALI's batches against fastai's own (PIL's decoder and resize): the pixels differ by the parity
# tests' tolerances (test_parity.py: mean ~0.2, max 9-25 levels of 255), the probabilities of a resnet18 by at most 0.0036
# (measured), with a margin. `load_learner`'s learner predicts with fastai's loaders (`DaliDataLoaders.new_empty`)
FASTAI_PRED_ATOL = 0.02

def gpu_keeps(cases, *kept):
    """Parameters of a test: all `cases` on the CPU backend (CI), the `kept` ones on the GPU. For tests whose cases differ
    in what fastai computes on the host (items, labels, splits, the same on either device): on the GPU each kind of
    batch the others send through the same pipeline is still there, and the suite's time is its pipeline builds"""
    assert set(kept) <= set(cases), set(kept) - set(cases)
    return list(cases) if DEVICE == 'cpu' else [c for c in cases if c in kept]

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

def make_noise_folder(root, n_train, n_valid, classes=CLASSES, seed=0, lo=40, hi=160):
    "ImageNet-style `root/{train,valid}/<class>/*.jpg` of random-noise crops, `n_train`/`n_valid` images per split in all (the classes in turn; `fastai_dali.samples.make_image_folder` makes photo crops, per class)"
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
            cache[key] = make_noise_folder(tmp_path_factory.mktemp(f'imgs_{n_train}_{n_valid}_{seed}'),
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

# The GPU suite runs in several processes (pytest-xdist; `gpu_results.sh suite` hands the tests out one at a time,
# `--dist worksteal`: under `--dist loadfile`, a file per process, test_resume.py's 8 tests of 40-100 s each alone outlasted
# a 320-s call, H100 2026-12-07), and lasts as long as its busiest process. The files go out longest first, by each file's seconds in a GPU run summed over its tests
# (H100, run 35 of 2026-12-07, 6 processes: test_step_graph 251, test_lifecycle 209, test_parity 195, test_training 170,
# test_abandoned_epochs 164, test_augment 130, test_factories 130, test_item_order 114, ...), so that no long file starts
# last. `test_resume.py` goes first: runs 34 and 35 began it last and the limit cut it after 172 s with 5 of its 8 tests
# left (its 2-rank tests, CPU ranks, are its longest). pytest-xdist itself
# hands out the files with the most tests first, whatever their length: in three runs that did so, `test_exactly_once.py`
# (one test) began when 94% of the tests were done and missed the 480 s limit. So its reordering is off
# (`--no-loadscope-reorder`, set here) and the collection order below decides. Within a file the order stays. A process
# starts a test only once it holds the next one too (fixtures are torn down by what comes next), so the process given a
# one-test file gets a second file at once. Where pytest-randomly (a test requirement) shuffles the files and the tests
# (its default; `.ci/run` prints the seed) this order is not applied; the GPU suite keeps it with `-p no:randomly`.
LONGEST_FIRST = ('test_resume.py', 'test_step_graph.py', 'test_lifecycle.py', 'test_parity.py', 'test_training.py',
                 'test_abandoned_epochs.py', 'test_augment.py', 'test_factories.py', 'test_item_order.py', 'test_exactly_once.py',
                 'test_optimizer.py', 'test_object_storage.py', 'test_user_commands.py', 'test_points_boxes.py',
                 'test_bad_input.py', 'test_shards.py', 'test_resize_window.py', 'test_segmentation.py', 'test_mixed.py',
                 'test_bench_cli.py', 'test_several_gpus_tutorial.py')

def pytest_configure(config):
    if hasattr(config.option, 'loadscopereorder'): config.option.loadscopereorder = False  # pytest-xdist's

def pytest_collection_modifyitems(session, config, items):
    if config.pluginmanager.hasplugin('randomly') and config.getoption('randomly_reorganize'): return   # its shuffled order
    rank = {f: i for i,f in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # a stable sort

def pytest_collection_finish(session):
    # What is alive once the test files are imported (torch, fastai, DALI, hypothesis: ~550,000 objects) lives as long
    # as the process. Out of the garbage collector's sight (`gc.freeze`), the full collection each GPU build runs
    # (`collect_dropped`, 02b_lifetime) takes milliseconds instead of 0.3-0.7 s; what tests create is collected as before
    gc.collect(); gc.freeze()

@pytest.fixture(scope='module', autouse=True)
def _give_back_gpu_memory():
    """After each test file on the GPU: the memory its pipelines and models freed goes back to the GPU. DALI's and torch's
    pools keep freed memory for their process; the suite runs 4 processes on one GPU (plus the subprocesses of the
    console-command tests), and memory one process keeps, another cannot have. (No collection here: the last test's
    dropped pipelines keep the GPU decoder's state for the next file's first build, which then frees them)"""
    yield
    if DEVICE == 'cpu': return
    import nvidia.dali.backend as db
    db.ReleaseUnusedMemory()
    if torch.cuda.is_initialized(): torch.cuda.empty_cache()

# FASTAI_DALI_BUILD_LOG=FILE (scripts/gpu_suite.sh sets it): a JSON line per test with its seconds, the pipelines it
# built and the seconds they took (of which `collect_seconds` freed dropped loaders' pipelines first), and the DALI
# pipelines alive at its end (all this process's, earlier tests' too)
BUILD_LOG = os.environ.get('FASTAI_DALI_BUILD_LOG')

@pytest.fixture(scope='session')
def _build_counter():
    import fastai_dali.feed as F
    orig,orig_collect,stats = F.Feed.build,F.collect_dropped,{'n': 0, 's': 0.0, 'gc': 0.0}
    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        try: return orig(self, *args, **kwargs)
        finally: stats['n'] += 1; stats['s'] += time.perf_counter() - t
    def timed_collect(*args, **kwargs):  # part of a build: freeing dropped loaders' pipelines (see `collect_dropped`)
        t = time.perf_counter()
        try: return orig_collect(*args, **kwargs)
        finally: stats['gc'] += time.perf_counter() - t
    F.Feed.build,F.collect_dropped = timed,timed_collect
    yield stats
    F.Feed.build,F.collect_dropped = orig,orig_collect

@pytest.fixture(autouse=True)
def _log_builds(request):
    if not BUILD_LOG: yield; return
    import json
    stats = request.getfixturevalue('_build_counter')
    n,s,g,t = stats['n'],stats['s'],stats['gc'],time.perf_counter()
    yield
    rec = dict(test=request.node.nodeid, pid=os.getpid(), seconds=round(time.perf_counter()-t, 2),
               builds=stats['n']-n, build_seconds=round(stats['s']-s, 2), collect_seconds=round(stats['gc']-g, 2),
               live_pipelines=len(live_pipelines()))
    with open(BUILD_LOG, 'a') as f: f.write(json.dumps(rec) + '\n')

# Measured DALI-vs-fastai pixel differences, filled by test_parity.py. At the end of the run they go to a log file
# (FASTAI_DALI_PARITY_LOG, default _test_logs/pixel_differences.txt, git-ignored), not to the terminal, where a passing
# run should end on its summary line; `-v` prints the table too (the GPU suite's log keeps it).
PARITY_STATS = {}

def parity_table():
    "PARITY_STATS as the lines of a table"
    return [f"{'case':<42}{'mean|d|':>9}{'worst img mean':>16}{'p99.9':>8}{'max|d|':>8}"] + [
        f"{k:<42}{v['mean']:>9.3f}{v['img_mean']:>16.3f}{v['p999']:>8.1f}{v['max']:>8.1f}" for k,v in sorted(PARITY_STATS.items())]

def pytest_terminal_summary(terminalreporter, config):
    # the order to replay a failure with (pytest-randomly names its seed in the header, which -q leaves out)
    if config.pluginmanager.hasplugin('randomly') and getattr(config.option, 'randomly_reorganize', False):
        terminalreporter.write_line(f'tests run in a shuffled order: replay it with -p randomly --randomly-seed={config.option.randomly_seed}')
    if not PARITY_STATS: return
    log = Path(os.environ.get('FASTAI_DALI_PARITY_LOG') or config.rootpath/'_test_logs'/'pixel_differences.txt')
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text('DALI vs fastai pixel differences (0..255 units), device ' + DEVICE + '\n' + '\n'.join(parity_table()) + '\n')
    if config.option.verbose > 0:
        terminalreporter.section('DALI vs fastai pixel differences (0..255 units)')
        for l in parity_table(): terminalreporter.write_line(l)
        terminalreporter.write_line(f'(also in {log})')

# ------------------------------------------------------------------ images that carry their item id (exactness tests)
# `root/{train,valid}/<class>/<id>.png`, 8x8 solid PNGs whose colour encodes the id: the package's own (`bench-gpus`
# checks exactness with them), valid ids from VALID0, class `cls_of(id)`
from fastai_dali.bench.gpus import id_folder as make_id_folder, id_tensor, VALID0
CLS = ('a', 'b', 'c')

def cls_of(i): return CLS[i % 3]

def id_of(f): return int(Path(f).stem)

def ids_of(x):
    "Item id of each image of batch `x`; -1 where the pixels are not one solid colour"
    return id_tensor(x, solid=True).tolist()

# ------------------------------------------------------------------ loader shards in one process (test_exactly_once, test_shards)
def epoch_ids(dl):
    "(item ids from the pixels, item ids from the labels (a class per item), batch sizes) of one epoch of `dl`"
    px,lb,sizes = [],[],[]
    for x,y in dl:
        px += id_tensor(x).tolist(); lb += [int(dl.vocab[int(o)]) for o in plain(y)]; sizes.append(len(y))
    return px,lb,sizes

def gathered_valid(shards):
    "The validation ids of `shards` (one `DataLoaders` per loader shard) as fastai gathers them: batch j of every shard in shard order, then batch j+1...; each shard's pixels and labels checked to agree, and its batch count to be the others'"
    per_shard = []
    for d in shards:
        px,lb,sizes = epoch_ids(d.valid)
        assert px == lb and len(sizes) == len(d.valid) == len(shards[0].valid)
        per_shard.append(np.split(np.array(px, dtype=int), np.cumsum(sizes)[:-1]) if sizes else [])
    return [int(i) for j in range(len(shards[0].valid)) for b in per_shard for i in b[j]]

class IdNet(nn.Module):
    "A linear classifier on the mean colour, plus one more column: the id its input encodes"
    def __init__(self, n_cls=3): super().__init__(); self.lin = nn.Linear(3, n_cls)
    def forward(self, x):
        x = x.as_subclass(torch.Tensor)
        return torch.cat([self.lin(x.mean((2, 3))), id_tensor(x, solid=True)[:, None].float()], 1)

class IdLoss:
    "Cross entropy on the class columns; predictions keep the id column"
    def __call__(self, out, y): return F.cross_entropy(out[:, :-1], y.as_subclass(torch.Tensor))
    def activation(self, out): return torch.cat([F.softmax(out[:, :-1], -1), out[:, -1:]], 1)
    def decodes(self, out): return out[:, :-1].argmax(-1)


# ------------------------------------------------------------------ lifecycle and leaks (test_lifecycle, test_abandoned_epochs)
import collections, ctypes, faulthandler, gc, time, traceback
from fastai.vision.all import (DataBlock, ImageBlock, CategoryBlock, GrandparentSplitter, Resize, get_image_files,
                               parent_label, Callback)
from fastai_dali.data import DaliDataLoaders
from fastai_dali.lifetime import _live_pipes, _deferred, collect_dropped

N_TRAIN, N_VALID, BS = 43, 22, 6       # train: 7 batches (drop_last drops 1 item); valid: 6,6,6,4
HANG_S = 300                           # backstop: dump every thread's stack and exit if a test hangs this long
# Growth of malloc'd memory (KB, see `malloc_stats`) per interval (SAMPLE cycles; 5 epochs), median over the intervals:
# under the smallest leak these tests look for (a pipeline kept per rebuild, ~6.5 MB each; one batch kept per epoch,
# ~2.9 MB per 5 epochs), over what the tests' own records add (~80 KB per interval; see the docstring)
MALLOC_TOL_STEP = 1_000
MALLOC_TOL_EPOCHS = 1_000


@pytest.fixture
def hang_guard():
    "A hang that no `run_with_timeout` catches ends the run with every thread's traceback, instead of blocking CI"
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


# ---------------------------------------------------------------------------------------------- items
@pytest.fixture(scope='module')
def id_root(tmp_path_factory): return make_id_folder(tmp_path_factory.mktemp('ids'))

def read_bytes(f): return Path(f).read_bytes()

def bytes_block(get_x=read_bytes, item_tfms=None):
    "get_x returns the encoded image: DALI's external_source path"
    return DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files, get_x=get_x, get_y=parent_label,
                     splitter=GrandparentSplitter(), item_tfms=item_tfms or [Resize(4)])

def id_loaders(root, kind='files', bs=BS, **kw):
    if kind == 'files': return DaliDataLoaders.from_folder(root, item_tfms=Resize(4), bs=bs, device=DEVICE, **kw)
    return bytes_block().dali_dataloaders(root, bs=bs, device=DEVICE, py_workers=2 if kind == 'workers' else 0, **kw)

def labels_of(dls, ids): return [dls.vocab.o2i[cls_of(i)] for i in ids]

def check_batch(dls, b, pool, bs=None):
    "The ids of batch `b`, after checking they are distinct items of `pool` carrying their own labels"
    ids = ids_of(b[0])
    assert -1 not in ids and set(ids) <= pool, ids
    assert len(set(ids)) == len(ids), f"an item twice in one batch: {ids}"
    assert plain(b[1]).tolist() == labels_of(dls, ids), "labels do not follow their images"
    if bs is not None: assert len(ids) == bs
    return ids

def check_train_epoch(dls, batches):
    "A full train epoch: len(dl) full batches of distinct training items, each with its label"
    tr = {id_of(f) for f in dls.train_ds.items}
    assert len(batches) == len(dls.train), f"{len(batches)} batches, len(dl) = {len(dls.train)}"
    ids = [i for b in batches for i in check_batch(dls, b, tr, dls.train.bs)]
    assert len(set(ids)) == len(ids), "an item came twice in one epoch"
    return ids

def check_valid_epoch(dls, batches):
    "A full valid epoch: every valid item once, in item order, with its label"
    ids = [i for b in batches for i in check_batch(dls, b, {id_of(f) for f in dls.valid_ds.items})]
    assert ids == [id_of(f) for f in dls.valid_ds.items]

# ---------------------------------------------------------------------------------------------- a tiny learner
class RecordIds(Callback):
    "Every batch the model sees, per epoch: (training, ids, labels)"
    order = 99
    def before_fit(self): self.epochs = []
    def before_epoch(self): self.epochs.append([])
    def before_batch(self):
        self.epochs[-1].append((self.training, ids_of(self.xb[0]), plain(self.yb[0]).tolist()))

def rss_kb(): return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1])

def n_tasks(): return len(os.listdir('/proc/self/task'))
def n_fds(): return len(os.listdir('/proc/self/fd'))
def n_children():
    "Live child processes of this one (DALI's Python workers, multiprocessing's resource tracker)"
    me,n = os.getpid(),0
    for p in os.listdir('/proc'):
        if not p.isdigit(): continue
        try:
            with open(f'/proc/{p}/stat') as f: st = f.read()
        except OSError: continue
        n += int(st[st.rindex(')')+2:].split()[1]) == me  # the fields after "(name)": state, ppid, ...
    return n

# glibc's malloc (Linux). RSS is no measure of a leak in a test session: glibc keeps freed memory in its arenas, and
# its thresholds move with what the process allocated before (freeing an mmapped block raises the mmap threshold to its
# size, up to 32 MB, and the trim threshold to twice that). After the test files that run before this one, blocks up
# to 32 MB (batches, DALI's buffers) come from the arenas, which hold ~3 GB of free memory; an allocation that lands on
# a free page never touched before makes it resident. Measured (scripts/memory_epochs.py, and this file's prints):
# 20 epochs alone, RSS +0.4..1.3 MB; after test_augment, test_bad_input, test_exactly_once and test_factories +2.9 MB
# (11.5 MB once on a fresh clone), with malloc'd memory +84 KB in both; with MALLOC_MMAP_THRESHOLD_=131072 (a fixed
# threshold) the arenas keep 64 MB free and RSS grows by 0.38 MB. Over 200 epochs in a fresh process RSS grows
# 2-5 MB, and malloc_trim(0) then gives back 8-14 MB (free memory); the memory the program holds grows by fastai's
# Recorder only (a loss per batch, ~1 KB). So the checks read what glibc says the process holds (`in_use`: chunks in
# use in every arena plus mmapped ones), not what it keeps free. Not in it: Python's small-object arenas (their
# objects are in `live_objects`) and CUDA's pinned host memory (cudaHostAlloc; a leaked pipeline shows in
# `live_pipelines()` and the native threads).
_libc = ctypes.CDLL(None)

class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in 'arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost'.split()]
class _MallInfo(ctypes.Structure):  # glibc < 2.33: int fields, which wrap at 4 GB (differences below 2 GB stay exact)
    _fields_ = [(n, ctypes.c_int) for n in 'arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost'.split()]

def malloc_stats():
    "glibc's counters (KB): `in_use` (in arenas + mmapped) and `free` (kept in its arenas)"
    f = getattr(_libc, 'mallinfo2', None)
    if f is None: f = _libc.mallinfo; f.restype = _MallInfo
    else: f.restype = _MallInfo2
    m = f()
    return dict(in_use=((m.uordblks + m.hblkhd) % 2**32 if f.restype is _MallInfo else m.uordblks + m.hblkhd)//1024,
                free=(m.fordblks % 2**32)//1024)

def kb_diff(a, b):
    "b - a for KB counters that may have wrapped at 4 GB (old glibc's mallinfo)"
    return (b - a + 2**21) % 2**22 - 2**21

def live_objects():
    "Live gc-tracked objects by type (after a collection)"
    gc.collect()
    return collections.Counter(map(type, gc.get_objects()))

def tracked_in(*roots):
    "The gc-tracked containers in (nested lists, tuples and dicts of) `roots`, by type: test bookkeeping to leave out"
    res,todo = collections.Counter(),list(roots)
    while todo:
        o = todo.pop()
        if isinstance(o, (list, tuple, dict)):
            if gc.is_tracked(o): res[type(o)] += 1
            todo.extend(o.values() if isinstance(o, dict) else o)
    return res

def accumulating(census):
    """Types whose live count grew in every interval between the censuses `{step: Counter}` by at least the number of
    steps (cycles, epochs) in it: {type name: counts}. One or more per step accumulates; a cache or pool filled once,
    in one interval, does not"""
    ks = sorted(census)
    ts = set().union(*census.values())
    return {f'{t.__module__}.{t.__qualname__}': [census[k].get(t, 0) for k in ks] for t in ts
            if all(census[b].get(t, 0) - census[a].get(t, 0) >= b - a for a,b in zip(ks, ks[1:]))}

def median(xs): return sorted(xs)[len(xs)//2]

def live_pipelines():
    "The DALI pipelines alive: those the loaders registered, and those a collection in another thread kept for the next build to shut down (02_pipeline)"
    return [*_live_pipes, *_deferred]

def pipelines_now():
    "Mark the DALI pipelines alive now (see `new_pipelines`); the mark"
    mark = object()
    for p in live_pipelines(): p._test_mark = mark
    return mark

def new_pipelines(mark):
    "The ids of the DALI pipelines alive now that `pipelines_now()` did not mark: told by the mark, not by id (a pipeline freed since may have left its address to a new one) nor by a weak reference (a pipeline collected in another thread lives on in `_deferred`, its weak references cleared)"
    return {id(p) for p in live_pipelines() if getattr(p, '_test_mark', None) is not mark}

def pipes_of(*dls):
    "The DALI pipelines these loaders hold now: the one each iterates and those kept for the loaders made from it"
    return {id(b.pipeline) for dl in dls for b in [dl.built, *dl.pipelines] if b is not None}

def resources(settle_to=None, wait=3.0, collect=True):
    """Threads, native threads, fds, child processes, live DALI pipelines, malloc'd memory and RSS (KB), after a
    garbage collection if `collect` (~0.3 s in a test session). A dropped pipeline's threads exit asynchronously (right
    after an epoch the count is up to ~10 above its resting value): poll for up to `wait` s, until the counts come down
    to `settle_to`'s (if given), else keep the lowest seen"""
    if collect: gc.collect(); collect_dropped(gpu=False)  # and, as the next build would, shut down what collections in other threads kept
    t_end,best = time.monotonic() + wait,None
    while True:
        cur = dict(threads=threading.active_count(), tasks=n_tasks(), fds=n_fds(), children=n_children(),
                   pipes=len(live_pipelines()))
        best = cur if best is None else {k: min(best[k], cur[k]) for k in cur}
        if settle_to is not None and all(best[k] <= settle_to[k] for k in best): break
        if time.monotonic() > t_end: break
        time.sleep(0.05)
    return dict(best, **malloc_stats(), rss=rss_kb())

COUNTS = ('threads', 'tasks', 'fds', 'children', 'pipes')

def exc_text(e):
    "The message and full traceback of `e`, chained exceptions included"
    return str(e) + '\n' + ''.join(traceback.format_exception(type(e), e, e.__traceback__))

def _as_batch(rec):
    "A recorded (training, ids, labels) back as an (x, y) batch that `check_batch` decodes"
    _,ids,ys = rec
    x = torch.zeros(len(ids), 3, 1, 1)
    x[:, 0, 0, 0] = torch.tensor([i % 256 for i in ids])/255
    x[:, 1, 0, 0] = torch.tensor([i // 256 for i in ids])/255
    return x, torch.tensor(ys)

def seen_by_a_worker(src, i, bs=2):
    "What one of DALI's worker processes sees of the per-batch source `src` (an `EpochSource` over it, pickled as the workers receive it: a file): its length, the md5 of item `i`'s bytes, and whether torch and fastai got imported (as strings)"
    import hashlib, subprocess, sys
    from fastai_dali.sources import EpochSource
    es = EpochSource(src, len(src), bs)
    load,(fn,) = es.__reduce__()  # (the file lives while `es` does)
    code = (f"import sys, hashlib; from fastai_dali.sources import {load.__name__}; s = {load.__name__}({fn!r}).src; "
            f"print(len(s), hashlib.md5(bytes(s[{i}])).hexdigest(), 'torch' in sys.modules, 'fastai' in sys.modules)")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.split()

"""Nothing accumulates: abandoned epochs, `lr_find`, a long run (the rest of the lifecycle: `test_lifecycle.py`).

The items and `IdNet` are `test_lifecycle.py`'s (`make_id_folder`, `IdNet` in `conftest.py`): each sample's pixels say
which item it is, and its label which class it must carry.

What each group asserts (numbers measured on the 2-core CPU machine this was written on, DALI 2.4 CPU backend):
- Abandoned epochs: cycles of train `one_batch` / valid `one_batch` / break out of a train epoch after k batches /
  a full train epoch / a full valid epoch (100 cycles here, ~0.1 s each, 40 with workers; 8..30 on a GPU, where each
  of a reader's 3-5 rebuilds per cycle takes ~0.4 s): every batch correct, and nothing accumulates (see "Leaks"
  below), sampled every few cycles after as many warm-up cycles (`CYCLES`). With `py_workers` > 0 the loader keeps
  its pipeline and worker processes through every cycle (`EpochFlag`), and its train and valid pipelines are built
  at once (`build_at_once`: each build spawns the workers, which import torch and fastai first, ~13 s on the H200).
- `lr_find` (stops mid-epoch: 100 iterations, 7 batches an epoch), then `fit(1)`: len(dl) full train batches of
  distinct items with their labels, and every valid item once, in order.
- 20 epochs of `fit` (64x64 images): every epoch correct and reshuffled, and nothing accumulates over epochs 5..20.
- Leaks ("nothing accumulates"): the threads (Python and native, /proc/self/task), open fds, child processes and live
  DALI pipelines (`live_pipelines()`) grow in at most one interval between samples (a resource
  made once, late, grows once: on the H200 nvImageCodec could not create the hardware JPEG decoder's state
  once under the suite's load, fell back to its CUDA decoder, and 6 more fds stayed open from then on), and the only pipelines alive
  that the test made are its loaders' current and kept ones; no type of Python object (gc census, the test's own records left
  out) grows in every interval by one or more per cycle or epoch; malloc'd memory (glibc's count of what the process
  holds, `malloc_stats`) grows by at most `MALLOC_TOL_*` per interval, median over the intervals (a leak per rebuild,
  cycle or epoch shows in every interval; a pool that grows once, in one). Measured here, in 5 runs: malloc'd memory
  per 10 cycles -56..234 KB (files), -22..215 KB (bytes), -23..230 KB (workers); per 5 epochs 76..83 KB (the census
  itself). A pipeline kept alive per rebuild adds ~6.5 MB of malloc'd memory each (195 MB per 10 cycles, and 9 native
  threads per cycle); a batch kept per epoch ~2.97 MB per 5 epochs (and a tensor per epoch in the census).
  Not RSS: glibc keeps freed memory in its arenas, and how much it keeps, and which of its pages are resident, depends
  on what the process allocated before, i.e. on the tests that ran before (see `malloc_stats`).
"""
import time

import pytest
from fastai.vision.all import Resize, Learner, Callback
from fastai_dali.data import DaliDataLoaders

from conftest import live_pipelines, pipelines_now, new_pipelines, build_at_once, id_of, IdNet, IdLoss
from conftest import DEVICE, run_with_timeout
from conftest import (BS, MALLOC_TOL_STEP, MALLOC_TOL_EPOCHS, id_loaders, labels_of, check_batch, check_train_epoch,
                      check_valid_epoch, RecordIds, resources, COUNTS, kb_diff, live_objects, tracked_in, accumulating,
                      median, pipes_of, _as_batch)

pytestmark = pytest.mark.usefixtures('hang_guard')  # a hang ends the run with every thread's traceback

# ------------------------------------------------------------------------------------ 1. abandoned epochs
# (cycles, SAMPLE) per kind. A reader's cycle rebuilds 3 to 5 pipelines: ~0.1 s here, ~1.9 s on the H200 (a GPU
# pipeline's build is slow); a Python source keeps its one pipeline (and its worker processes) through every cycle.
# Resources are sampled every SAMPLE cycles (the first sample, after SAMPLE warm-up cycles, is the reference), live
# objects at the reference, the middle sample and the last one. Every k (1..6 batches before abandoning) comes twice
# or more (once or more on a GPU, whose 8 reader cycles take ~90 s of the 4-process suite: 4 samples, 3 intervals), and a
# pipeline kept per rebuild adds 10+ pipelines, threads and ~6.5 MB each between two samples.
CYCLES = (dict(files=(100, 10), bytes=(100, 10), workers=(40, 10)) if DEVICE == 'cpu' else
          dict(files=(8, 2), bytes=(30, 5), workers=(30, 5)))

@pytest.mark.parametrize('kind', ['files', 'bytes', 'workers'])
def test_abandoned_epochs_cycles(id_root, kind):
    pre = pipelines_now()           # pipelines of earlier tests, still alive or not yet collected
    dls = id_loaders(id_root, kind, num_threads=1)
    if kind == 'workers': build_at_once(dls.train, dls.valid)   # their worker processes start at the same time
    tr,va = {id_of(f) for f in dls.train_ds.items},[id_of(f) for f in dls.valid_ds.items]
    n,(n_cycles,SAMPLE) = len(dls.train),CYCLES[kind]
    at = (SAMPLE, SAMPLE*((n_cycles//SAMPLE + 1)//2), n_cycles)
    samples,census = {},{}
    def cycle(c):
        check_batch(dls, dls.train.one_batch(), tr, BS)
        assert check_batch(dls, dls.valid.one_batch(), set(va)) == va[:BS]
        k = 1 + c % (n-1)                               # 1..n-1 batches, then abandon the epoch
        for j,b in enumerate(dls.train):
            check_batch(dls, b, tr, BS)
            if j+1 == k: break
        check_train_epoch(dls, list(dls.train))
        check_valid_epoch(dls, list(dls.valid))
    t0 = time.monotonic()
    for c in range(1, n_cycles+1):
        run_with_timeout(lambda: cycle(c), 60)
        if c % SAMPLE == 0:   # objects first: their census (a Counter) is then part of every later sample
            if c in at: census[c] = live_objects() - tracked_in(samples, census)  # (it collects garbage)
            samples[c] = resources(samples[max(samples)] if samples else None, collect=c not in at)  # settles to the last
    a,b = samples[SAMPLE],samples[n_cycles]
    steps = [kb_diff(samples[c]['in_use'], samples[c+SAMPLE]['in_use']) for c in range(SAMPLE, n_cycles, SAMPLE)]
    print(f"\n{kind}: {n_cycles} cycles in {time.monotonic()-t0:.1f} s; {samples}; malloc'd memory, growth per "
          f"{SAMPLE} cycles: {steps} KB; RSS growth: {b['rss']-a['rss']} KB; free memory glibc keeps: {b['free']} KB")
    # nothing accumulates: threads (Python and native), open files, worker processes, DALI pipelines grow in at most
    # one interval between samples (a resource made once, late); a leak per cycle or per few cycles grows in several
    # (fewer is fine: an earlier test's went meanwhile)
    cs = sorted(samples)
    assert len(cs) >= 3, cs
    grows = {k: [samples[c][k] for c in cs] for k in COUNTS
             if sum(samples[d][k] > samples[c][k] for c,d in zip(cs, cs[1:])) > 1}
    assert not grows, f"counts at cycles {cs}: {grows}"
    assert new_pipelines(pre) == pipes_of(dls.train, dls.valid), "a DALI pipeline outlives its loader"
    # ... Python objects of any type ...
    acc = accumulating(census)
    assert not acc, acc
    # ... and memory held through malloc: a leak per rebuild or per cycle shows in every interval, so in the median
    # (one pipeline kept alive is ~6.5 MB here), unlike a pool that grows once
    assert median(steps) <= MALLOC_TOL_STEP, steps
    # a Python source ends an abandoned epoch early (EpochFlag) and keeps its pipeline and workers; readers rebuild
    if kind != 'files': assert (dls.train.n_builds, dls.valid.n_builds) == (1, 1)

def test_lr_find_then_fit(id_root):
    dls = id_loaders(id_root)
    rec = RecordIds()
    learn = Learner(dls, IdNet(), loss_func=IdLoss(), cbs=rec)
    tr = {id_of(f) for f in dls.train_ds.items}
    with learn.no_bar(): run_with_timeout(lambda: learn.lr_find(show_plot=False, stop_div=False), 120)
    n_it = len(learn.recorder.lrs)
    assert n_it == 100 and n_it % len(dls.train), "lr_find did not stop mid-epoch: nothing was abandoned"
    for ep in rec.epochs:
        for training,ids,ys in ep:
            assert training and -1 not in ids and set(ids) <= tr and len(set(ids)) == len(ids) == BS
            assert ys == labels_of(dls, ids)
    with learn.no_bar(), learn.no_logging(): run_with_timeout(lambda: learn.fit(1, 1e-3), 120)
    (ep,) = rec.epochs
    t,v = [b for b in ep if b[0]],[b for b in ep if not b[0]]
    check_train_epoch(dls, [_as_batch(b) for b in t])
    check_valid_epoch(dls, [_as_batch(b) for b in v])

# ------------------------------------------------------------------------------------ 2. long run
class RecordFootprint(Callback):
    """After each epoch: `resources()`, with a garbage collection and a census of live objects (leaving out the test's
    own records, `rec`) only after the epochs in `at`. fastai's Recorder keeps a smoothed loss per batch and a row per
    epoch, by design: cleared here, so that what could grow is the loader's"""
    order = 100
    def __init__(self, rec, at): self.rec,self.at = rec,at
    def before_fit(self): self.rows,self.census = [],{}
    def after_epoch(self):
        for k in ('losses', 'lrs', 'iters', 'values'): getattr(self.learn.recorder, k).clear()
        n,prev = len(self.rows) + 1,(self.rows[-1] if self.rows else None)
        if n not in self.at: self.rows.append(resources(collect=False, wait=0)); return
        self.census[n] = live_objects() - tracked_in(self.rec.epochs, self.rows, self.census)  # first: it is in later readings
        self.rows.append(resources(prev, collect=False))  # garbage just collected by the census

def test_20_epochs_nothing_accumulates(id_root):
    pre = pipelines_now()
    # 64x64 images (solid, so still decodable): keeping one batch per epoch is ~580 KB of malloc'd memory per epoch
    dls = DaliDataLoaders.from_folder(id_root, item_tfms=Resize(64), bs=BS, device=DEVICE, num_threads=1)
    rec = RecordIds()
    at = (5, 10, 15, 20)
    mem = RecordFootprint(rec, at)
    learn = Learner(dls, IdNet(), loss_func=IdLoss(), cbs=[rec, mem])
    with learn.no_bar(), learn.no_logging(): run_with_timeout(lambda: learn.fit(20, 1e-2), 240)
    assert len(rec.epochs) == len(mem.rows) == 20
    orders = []
    for ep in rec.epochs:
        orders.append(check_train_epoch(dls, [_as_batch(b) for b in ep if b[0]]))
        check_valid_epoch(dls, [_as_batch(b) for b in ep if not b[0]])
    assert len({tuple(o) for o in orders}) == 20, "train epochs repeat an order: no reshuffle"
    a,rows = mem.rows[4],mem.rows[4:]
    steps = [kb_diff(mem.rows[i-1]['in_use'], mem.rows[j-1]['in_use']) for i,j in zip(at, at[1:])]
    print(f"\nmalloc'd memory growth per 5 epochs (garbage collected after epochs {at}): {steps} KB; after epochs 5..20: "
          f"free memory glibc keeps {[r['free'] for r in rows]} KB; RSS growth {[r['rss']-a['rss'] for r in rows]} KB; {a}")
    # nothing accumulates over epochs 5..20: threads, files, processes, pipelines (train's and valid's, kept) ...
    for i,r in enumerate(rows):
        more = {k: (a[k], r[k]) for k in COUNTS if r[k] > a[k]}
        assert not more, f"epoch {i+5}, (at epoch 5, now): {more}"
    assert new_pipelines(pre) == pipes_of(dls.train, dls.valid)
    assert (dls.train.n_builds, dls.valid.n_builds) == (1, 1)
    # ... Python objects of any type ...
    acc = accumulating(mem.census)
    assert not acc, acc
    # ... and memory held through malloc (a leak per epoch shows in every interval, so in the median)
    assert median(steps) <= MALLOC_TOL_EPOCHS, steps

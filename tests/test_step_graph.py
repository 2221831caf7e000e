"""`StepGraphCallback` on a GPU: the whole training step (forward, loss, backward, fastai's optimizer step) captured as
one CUDA graph and replayed, in fastai's `fit` over `DaliDataLoaders` (the CPU checks, with a stand-in for the
graph, are in nbs/04e_graphs.ipynb).

- the same records, predictions and weights as fastai's own step, no farther than fastai's own spread (how far torch's
  AdamW through fastai's `OptimWrapper` ends from fastai's `Adam`: the same formulas, rounded otherwise; the rule of the
  CPU checks) in fp32 and in bf16, the model's own kernels; with the model compiled, within the tolerances of
  `CudaGraphCallback`'s check (compiling's own distance); the optimizer's foreach ops compiled (`compile_opt`), within
  fastai's spread; a control whose replays train nothing fails each comparison;
- no host sync in a replayed training batch (`torch.cuda.set_sync_debug_mode('warn')`);
- `fine_tune` (two fits, a capture each), `lr_find` (the weights back as fastai puts them back), an interrupted fit
  (the learner fastai's again, and it trains again).
"""
import warnings
from functools import partial
import pytest, torch
from torch import nn
from fastai.vision.all import Learner, Callback, Resize, Normalize, imagenet_stats, OptimWrapper, Adam
from fastai.callback.schedule import *  # fine_tune, lr_find
from fastai_dali.data import DaliDataLoaders
from fastai_dali.optimizer import ForeachAdam
from fastai_dali.graphs import StepGraphCallback
from conftest import is_sync_warning, DEVICE, make_id_folder

pytestmark = pytest.mark.skipif(DEVICE == 'cpu', reason='CUDA graphs need a GPU: the GPU suite runs this (the CPU checks are in nbs/04e_graphs.ipynb)')

@pytest.fixture(scope='module')
def id_root(tmp_path_factory): return make_id_folder(tmp_path_factory.mktemp('ids'))

def small_cnn(n_out):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, n_out))

torch_adamw = partial(OptimWrapper, opt=partial(torch.optim.AdamW, betas=(0.9, 0.99), eps=1e-5, weight_decay=0.))

def run(root, opt_func=ForeachAdam, cb=None, lr=1e-2, bf16=False, epochs=3):
    "`epochs` epochs of `fit_one_cycle` (wd 0): the learner, and its batch losses, valid records, predictions, weights (flat, on the CPU)"
    dls = DaliDataLoaders.from_folder(root, item_tfms=Resize(8), batch_tfms=Normalize.from_stats(*imagenet_stats), bs=6,
                                      device=DEVICE, shuffle=False)
    dls.fast_path = False   # (each run's optimizer the one it names: the fast path would make fastai's `Adam` its twin)
    learn = Learner(dls, small_cnn(dls.c).cuda(), lr=lr, wd=0., opt_func=opt_func, cbs=[cb] if cb is not None else None)
    if bf16: learn.to_bf16()
    with learn.no_bar(): learn.fit_one_cycle(epochs)   # (rates and momentum changed each batch: they must reach the replays)
    r = learn.recorder  # (read before `get_preds`, which empties the records)
    assert len(r.losses) == epochs*len(dls.train) and len(r.values) == epochs
    losses,values = torch.tensor([float(l) for l in r.losses]),torch.tensor(r.values)
    preds,_ = learn.get_preds()
    return learn,(losses, values, preds.float().cpu(), torch.cat([p.detach().flatten().cpu() for p in learn.model.parameters()]))

def rel(a, b): return ((a-b).abs().max()/b.abs().max().clamp_min(1e-12)).item()

@pytest.mark.parametrize('bf16', [False, True], ids=['fp32', 'bf16'])
def test_step_graph_trains_as_fastai(id_root, monkeypatch, bf16):
    monkeypatch.setattr(torch.backends.cudnn, 'deterministic', True)
    _,fastai_adam = run(id_root, Adam, bf16=bf16)
    _,theirs = run(id_root, torch_adamw, bf16=bf16)
    # fastai's own spread (the largest of the four), at least float32's rounding of a step
    spread = max(max(rel(a, b) for a,b in zip(theirs, fastai_adam)), 1e-6)
    _,eager = run(id_root, bf16=bf16)
    cb = StepGraphCallback(compile=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        learn,graphed = run(id_root, cb=cb, bf16=bf16)
    # fastai's own step on each epoch's last, smaller batch runs its backward on the default stream, after the captured
    # ones on the side stream: torch warned of the accumulation nodes' streams while the graph kept its autograd graph
    # (GPU suite run 35, this test, fp32)
    assert not [w for w in caught if 'AccumulateGrad' in str(w.message)], [str(w.message)[:200] for w in caught]
    dl = learn.dls.train
    full = dl.n//dl.bs   # (43 items, bs 6, no drop_last: 7 full batches an epoch, then one of 1: fastai's own step)
    # the first batch (no gradient yet: a step of its own) and 3 to warm up run eagerly, the 5th is captured and replayed
    assert cb.counts == dict(replayed=3*full-4, captured=1, eager=4, fastai=3*(len(dl)-full)), cb.counts
    d = [rel(a, b) for a,b in zip(graphed, eager)]
    print(f'step graph {"bf16" if bf16 else "fp32"}: fastai\'s spread {spread:.1e}, graphed vs eager {[f"{x:.1e}" for x in d]}')
    assert max(d) <= 3*spread, (d, spread)
    # control: replays that train nothing (a rate of 0) fail it
    _,frozen = run(id_root, cb=StepGraphCallback(compile=False), lr=0., bf16=bf16)
    assert max(rel(a, b) for a,b in zip(frozen, eager)) > 3*spread

def test_step_graph_compiled(id_root, monkeypatch):
    """The model's kernels compiled (mode 'default') inside the graph: within the tolerances of `CudaGraphCallback`'s
    check (tests/test_training.py: ~10x compiling's own distance from the model itself, measured on the H200)"""
    monkeypatch.setattr(torch.backends.cudnn, 'deterministic', True)
    _,eager = run(id_root)
    cb = StepGraphCallback()
    _,graphed = run(id_root, cb=cb)
    assert cb.counts['captured'] == 1 and cb.counts['replayed'] > 0, cb.counts
    tols = (1e-5, 1e-3, 1e-3, 5e-3)  # batch losses, valid records, predictions, weights
    for a,b,t in zip(graphed, eager, tols): torch.testing.assert_close(a, b, rtol=0, atol=t)
    _,frozen = run(id_root, cb=StepGraphCallback(), lr=0.)
    for i in (0, 1, 3): assert not torch.allclose(frozen[i], eager[i], rtol=0, atol=tols[i])

def test_step_graph_compiled_optimizer(id_root, monkeypatch):
    """fastai's Adam with its foreach ops compiled (`compile_opt`: Inductor's fused kernels inside the graph): no farther
    from the same graph with the foreach ops as they come than fastai's own spread (the rule of
    `test_step_graph_trains_as_fastai`), fp32"""
    monkeypatch.setattr(torch.backends.cudnn, 'deterministic', True)
    _,fastai_adam = run(id_root, Adam)
    _,theirs = run(id_root, torch_adamw)
    spread = max(max(rel(a, b) for a,b in zip(theirs, fastai_adam)), 1e-6)
    _,eager = run(id_root, cb=StepGraphCallback(compile=False))
    cb = StepGraphCallback(compile=False, compile_opt=True)
    from torch._dynamo.utils import counters
    made = counters['stats']['unique_graphs']
    limit = dict(fail_on_recompile_limit_hit=True) if hasattr(torch._dynamo.config, 'fail_on_recompile_limit_hit') else {}
    with torch._dynamo.config.patch(**limit): _,graphed = run(id_root, cb=cb)   # (no bucket left to its eager ops past Dynamo's limit)
    assert cb.counts['captured'] == 1 and cb.counts['replayed'] > 0, cb.counts
    # compiled: the callback's own copy of `bucket_step`, of which Dynamo made graphs in this fit
    assert cb.bucket._torchdynamo_orig_callable.__name__ == 'bucket_step' and counters['stats']['unique_graphs'] > made
    d = [rel(a, b) for a,b in zip(graphed, eager)]
    print(f"step graph, compiled optimizer: fastai's spread {spread:.1e}, against the eager foreach ops {[f'{x:.1e}' for x in d]}")
    assert max(d) <= 3*spread, (d, spread)
    _,frozen = run(id_root, cb=StepGraphCallback(compile=False, compile_opt=True), lr=0.)
    assert max(rel(a, b) for a,b in zip(frozen, eager)) > 3*spread

class SyncsInBatch(Callback):
    "Synchronizing torch calls from the last `before_batch` to the end of the batch's callbacks, per training batch the graph replayed"
    order = 100
    def __init__(self, cb): self.cb,self.per_batch = cb,[]
    def before_batch(self):
        if not self.training: return
        self.replays = self.cb.counts['replayed']
        self.w = warnings.catch_warnings(record=True); self.seen = self.w.__enter__()
        warnings.simplefilter('always'); torch.cuda.set_sync_debug_mode('warn')
    def after_batch(self):
        if not self.training: return
        torch.cuda.set_sync_debug_mode('default'); self.w.__exit__(None, None, None)
        if self.cb.counts['replayed'] > self.replays: self.per_batch.append(sum(is_sync_warning(w) for w in self.seen))

def test_no_host_sync_in_a_replayed_batch(id_root):
    cb = StepGraphCallback(compile=False)
    s = SyncsInBatch(cb)
    dls = DaliDataLoaders.from_folder(id_root, item_tfms=Resize(8), bs=6, device=DEVICE, shuffle=False)
    learn = Learner(dls, small_cnn(dls.c).cuda(), opt_func=ForeachAdam, cbs=[cb, s])
    with learn.no_bar(): learn.fit(2)
    assert len(s.per_batch) == cb.counts['replayed'] == 2*(dls.train.n//dls.train.bs) - 4, (cb.counts, s.per_batch)
    assert s.per_batch == [0]*len(s.per_batch), s.per_batch

class Stop(Callback):
    def after_batch(self):
        if self.training and self.train_iter == 6: raise KeyboardInterrupt()

def test_step_graph_fine_tune_lr_find_interrupted(id_root):
    dls = DaliDataLoaders.from_folder(id_root, item_tfms=Resize(8), bs=6, device=DEVICE, shuffle=False)
    cb = StepGraphCallback(compile=False, warmup=1)
    learn = Learner(dls, small_cnn(dls.c).cuda(), opt_func=ForeachAdam, cbs=[cb], splitter=lambda m: [list(m[:2].parameters()), list(m[2:].parameters())])
    before = [p.detach().clone() for p in learn.model.parameters()]
    with learn.no_bar(): sug = learn.lr_find(num_it=20, show_plot=False)
    assert all(torch.equal(p, q) for p,q in zip(learn.model.parameters(), before)) and sug.valley > 0   # fastai puts the weights back
    with learn.no_bar(): learn.fine_tune(1, 1e-2, freeze_epochs=1)
    assert cb.counts['captured'] == 1 and cb.counts['replayed'] > 0 and cb.graph is not None, cb.counts   # (the last fit's; its graph kept)
    try:
        with learn.no_bar(): learn.fit(2, cbs=Stop())
    except KeyboardInterrupt: pass
    assert cb.graph is None and '_do_one_batch' not in vars(learn) and learn.opt.captured is None
    with learn.no_bar(): learn.fit(1)
    assert cb.counts['captured'] == 1 and torch.isfinite(torch.tensor(learn.recorder.values[-1])).all()
    with learn.no_bar(): learn.fit(1)   # the graph of the fit before, replayed from the first batch
    assert cb.counts['captured'] == 0 and cb.counts['eager'] == 0 and cb.counts['replayed'] > 0, cb.counts
    cb.release(); assert cb.graph is None and learn.opt.captured is None

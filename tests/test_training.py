"""Training without a host sync per batch: `DeviceLossCallback` keeps fastai's smoothed loss on the device.

- fastai copies the loss to the CPU once per training batch (`AvgSmoothLoss.accumulate`'s `to_detach`); with the
  callback no training batch does, and the records (`recorder.losses`, `recorder.values`), `learn.smooth_loss` and
  the weights are fastai's own, with the progress bar on and off (DaliDataLoaders, on this run's device);
- on a GPU, `torch.cuda.set_sync_debug_mode('warn')` sees every synchronizing call of torch from the loss to the
  end of the batch's callbacks: at least one per batch with fastai's own smoothed loss, none with the callback; and
  none with `ForeachAdam` as the optimizer either; none in `DaliDL`'s own path from DALI's output to fastai's batch (targets, types, device);
- with `CudaGraphCallback` (training batches as CUDA graphs, GPU): the records, predictions and weights of the same
  compiled model without graphs, against a control that trains nothing, and close to the model itself;
  `export`/`load_learner` see the model itself, however training ends; no host sync in a graphed training batch.
"""
import warnings
import pytest, torch
from torch import nn
import fastai.learner
from fastai.vision.all import Learner, Callback, Resize, Normalize, imagenet_stats
from fastai.callback.core import CancelEpochException
from fastai_dali.data import DaliDataLoaders
from fastai_dali.training import DeviceLossCallback, DeviceSmoothLoss
from fastai_dali.graphs import CudaGraphCallback
from fastai_dali.optimizer import ForeachAdam
from conftest import is_sync_warning, DEVICE, make_id_folder, IdNet, IdLoss

@pytest.fixture(scope='module')
def id_root(tmp_path_factory): return make_id_folder(tmp_path_factory.mktemp('ids'))

def learner(root, cbs=None, fast_path=True, **kw):
    "`fast_path=False`: fastai's own loop (no `DaliFastPathCallback` swaps), the control of the callbacks' checks"
    torch.manual_seed(0)
    dls = DaliDataLoaders.from_folder(root, item_tfms=Resize(4), bs=6, device=DEVICE, shuffle=False)
    dls.fast_path = fast_path
    return Learner(dls, IdNet(), loss_func=IdLoss(), lr=1e-2, cbs=cbs, **kw)

class CountLossCopies(Callback):
    "Calls of fastai's `to_detach(..., cpu=True)` made by `fastai.learner` (the smoothed loss) during training batches"
    order = -10
    def before_fit(self):
        self.n,self.in_batch,self.orig = 0,False,fastai.learner.to_detach
        def counting(b, cpu=True, gather=True):
            if cpu and self.in_batch: self.n += 1
            return self.orig(b, cpu, gather)
        fastai.learner.to_detach = counting
    def before_batch(self):
        self.in_batch = self.training
        self.device_cbs = sum(isinstance(c, DeviceLossCallback) for c in self.learn.cbs)
    def after_fit(self): fastai.learner.to_detach = self.orig

@pytest.mark.parametrize('bar', [False, True])
def test_same_records_no_loss_copy(id_root, bar, monkeypatch):
    # (fastai's `to_detach` put back after the test, however it ends: `CountLossCopies` puts it back only in `after_fit`)
    monkeypatch.setattr(fastai.learner, 'to_detach', fastai.learner.to_detach)
    runs = {}
    # fastai's own loop; the fast path a Learner takes by default (its DeviceLossCallback); and that with a second
    # DeviceLossCallback of the user's (one stands aside)
    for name,cbs,fast in (('fastai', [], False), ('device', [], True), ('two', [DeviceLossCallback()], True)):
        count = CountLossCopies()
        learn = learner(id_root, cbs=count, fast_path=fast)
        if bar: learn.fit(2, cbs=cbs)
        else:
            with learn.no_bar(): learn.fit(2, cbs=cbs)
        r = learn.recorder
        runs[name] = (count.n, [float(l) for l in r.losses], [list(map(float, v)) for v in r.values],
                      float(learn.smooth_loss), [p.detach().cpu().clone() for p in learn.model.parameters()])
        assert count.device_cbs == dict(fastai=0, device=1, two=2)[name], (name, count.device_cbs)
        assert type(r.smooth_loss) is not DeviceSmoothLoss and all(l.device.type == 'cpu' for l in r.losses)
    (n_f,*ref),(n_d,*ours),(n_2,*two) = runs['fastai'],runs['device'],runs['two']
    n_batches = 2*len(learn.dls.train)
    assert (n_f, n_d, n_2) == (n_batches, 0, 0)
    for o in (ours, two): assert o[:3] == ref[:3] and all(torch.equal(a, b) for a,b in zip(o[3], ref[3]))

def test_lr_find_as_fastai(id_root):
    "`lr_find` decides each batch from the smoothed loss (it stops where the loss diverges): on the fast path DeviceLossCallback stands aside for it, so that value is fastai's own, on the CPU; the lrs and losses equal fastai's"
    class Seen(Callback):
        order = 99
        def before_fit(self): self.kinds = set()
        def after_batch(self): self.kinds.add(type(self.learn.recorder.smooth_loss).__name__)
    res = {}
    for fast in (False, True):
        seen = Seen()
        learn = learner(id_root, cbs=seen, fast_path=fast)
        with learn.no_bar(), learn.no_logging(): learn.lr_find(start_lr=1e-5, end_lr=10, num_it=12, show_plot=False)
        res[fast] = ([float(x) for x in learn.recorder.losses], [float(x) for x in learn.recorder.lrs], seen.kinds)
    assert res[True] == res[False] and res[True][2] == {'AvgSmoothLoss'}, res

def test_copies_of_the_class_keep_one_loss(id_root):
    "A second copy of `DeviceLossCallback`'s class (what running the module's cells again in a notebook, or a reload, makes: `isinstance` no longer sees the other) beside the fast path's own: one holds the loss, the other stands aside, and the records are fastai's"
    import importlib.util, fastai_dali.training as T
    from fastai.callback.core import defaults
    spec = importlib.util.spec_from_file_location('fastai_dali._training_copy', T.__file__)
    copy = importlib.util.module_from_spec(spec); spec.loader.exec_module(copy)
    from fastai_dali.patches import apply_patches
    # its DaliFastPathCallback registered, as a reload of the modules puts the copy in fastai's defaults
    defaults.callbacks[:] = [c for c in defaults.callbacks if not getattr(c, '_fastai_dali_fast_path', False)] + [copy.DaliFastPathCallback]
    try:
        assert not issubclass(copy.DeviceLossCallback, DeviceLossCallback)
        assert [c for c in defaults.callbacks if getattr(c, '_fastai_dali_fast_path', False)] == [copy.DaliFastPathCallback]  # once
        runs = {}
        for name,cbs,fast in (('fastai', [], False), ('copy', [DeviceLossCallback()], True)):
            learn = learner(id_root, cbs=cbs, fast_path=fast)
            with learn.no_bar(): learn.fit(2)
            r = learn.recorder
            runs[name] = ([float(l) for l in r.losses], [list(map(float, v)) for v in r.values], float(learn.smooth_loss))
            assert type(r.smooth_loss).__name__ == 'AvgSmoothLoss' and 'fastai_smooth_loss' not in vars(r)
        assert runs['copy'] == runs['fastai']
        assert sorted(type(c).__module__ for c in learn.cbs if type(c).__name__ == 'DeviceLossCallback') == ['fastai_dali._training_copy', 'fastai_dali.training']
    finally: apply_patches()

class SyncsInBatch(Callback):
    "Synchronizing torch calls from the loss to the end of the batch's callbacks (after ProgressCallback's), per training batch"
    order = 100
    def before_fit(self): self.per_batch = []
    def after_loss(self):
        if not self.training: return
        self.w = warnings.catch_warnings(record=True); self.seen = self.w.__enter__()
        warnings.simplefilter('always'); torch.cuda.set_sync_debug_mode('warn')
    def after_batch(self):
        if not self.training: return
        torch.cuda.set_sync_debug_mode('default'); self.w.__exit__(None, None, None)
        self.per_batch.append(sum(is_sync_warning(w) for w in self.seen))

@pytest.mark.skipif(DEVICE == 'cpu', reason='a host sync is a GPU matter: the GPU suite runs this')
def test_no_host_sync_per_training_batch(id_root):
    res = {}
    for name,cbs,kw in (('fastai', [], dict(fast_path=False)), ('device', [DeviceLossCallback()], dict(fast_path=False)),
                        ('device, ForeachAdam', [DeviceLossCallback()], dict(opt_func=ForeachAdam, fast_path=False)),
                        ("a Learner's defaults (the fast path)", [], {})):
        s = SyncsInBatch()
        learn = learner(id_root, cbs=[s, *cbs], **kw); learn.model.cuda()
        learn.fit(2)
        res[name] = s.per_batch
    assert all(n >= 1 for n in res['fastai']), res      # the check sees fastai's copy of the loss
    assert res['device'] == [0]*len(res['device']), res
    assert res['device, ForeachAdam'] == [0]*len(res['device']), res  # the foreach step syncs nothing either
    assert res["a Learner's defaults (the fast path)"] == [0]*len(res['device']), res

@pytest.mark.skipif(DEVICE == 'cpu', reason='a host sync is a GPU matter: the GPU suite runs this')
def test_no_host_sync_in_the_loader(id_root):
    dls = DaliDataLoaders.from_folder(id_root, item_tfms=Resize(4), batch_tfms=Normalize.from_stats(*imagenet_stats),
                                      bs=6, device=DEVICE)
    it = iter(dls.train); next(it)   # built, and its first batch out
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter('always'); torch.cuda.set_sync_debug_mode('warn')
        try: n = sum(len(next(it)[0]) for _ in range(3))
        finally: torch.cuda.set_sync_debug_mode('default')
    assert n == 18 and not [str(w.message) for w in seen if is_sync_warning(w)]
    for _ in it: pass

def small_cnn(n_out):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, n_out))

def graphs_run(root, lr, graphs):
    "3 epochs of `fit` (fp32, ForeachAdam, DeviceLossCallback; with `CudaGraphCallback` if `graphs`): records, predictions, weights"
    dls = DaliDataLoaders.from_folder(root, item_tfms=Resize(8), batch_tfms=Normalize.from_stats(*imagenet_stats), bs=6,
                                      device=DEVICE, shuffle=False)
    cb = CudaGraphCallback() if graphs else None
    learn = Learner(dls, small_cnn(dls.c).cuda(), lr=lr, opt_func=ForeachAdam, cbs=[DeviceLossCallback(), *([cb] if graphs else [])])
    model = learn.model
    with learn.no_bar(): learn.fit(3)
    assert learn.model is model  # the model itself again after the fit, for `get_preds`, `save`, `export`
    if graphs: assert cb.graphs is not None and cb.graphs is not model
    r = learn.recorder  # (read before `get_preds`: fastai's `validation_context` runs `before_fit`, which empties the records)
    assert len(r.losses) == 3*len(dls.train) and len(r.values) == 3, (len(r.losses), len(r.values))  # every record, or the comparisons see none
    losses,values = torch.tensor([float(l) for l in r.losses]),torch.tensor(r.values)
    preds,_ = learn.get_preds()
    return learn, losses, values, preds.cpu(), torch.cat([p.detach().flatten().cpu() for p in model.parameters()])

@pytest.mark.skipif(DEVICE == 'cpu', reason='CUDA graphs need a GPU: the GPU suite runs this (the CPU case is in nbs/04c_training.ipynb)')
def test_cuda_graphs_train_as_the_compiled_model(id_root, tmp_path, monkeypatch):
    """fastai's `fit` with training batches replayed as CUDA graphs: the records, predictions and weights of the same
    compiled model run without graphs (mode 'default', its kernels launched one by one), no farther from it than
    compiling moves the model itself, and a control that trains nothing far outside. Measured on the H200
    (`scripts/graphs_spread.py`, docs/results/gpu_suite/h200_graphs_spread.json): each kind of run repeats itself
    exactly; compiled vs the model itself 2.4e-7 (batch losses), 5.0e-5 (valid loss), 5.2e-5 (predictions), 2.7e-4
    (weights: BatchNorm after a convolution cancels its gradients nearly exactly, and Adam turns their rounding into
    steps); graphed vs compiled 2.4e-7, 4.3e-5, 7.4e-5, 4.3e-4 (mode 'reduce-overhead' does not launch the very same
    kernels; inductor's deterministic mode changes none of these); the control 0.08, 0.78, 0.59, 0.14"""
    monkeypatch.setattr(torch.backends.cudnn, 'deterministic', True)
    eager = graphs_run(id_root, 1e-2, False)
    compile = torch.compile
    with monkeypatch.context() as m:
        m.setattr(torch, 'compile', lambda model, mode=None, **kw: compile(model, mode='default', **kw))
        launched = graphs_run(id_root, 1e-2, True)
    graphed = graphs_run(id_root, 1e-2, True)
    tols = (1e-5, 1e-3, 1e-3, 5e-3)  # losses, valid records, predictions, weights: ~10x compile's own distance above
    for a,b,t in zip(graphed[1:], launched[1:], tols): torch.testing.assert_close(a, b, rtol=0, atol=t)
    for a,b,t in zip(graphed[1:], eager[1:], tols): torch.testing.assert_close(a, b, rtol=0, atol=t)
    # control: a replay that trained nothing (stale weights, lost steps) fails the same comparisons
    frozen = graphs_run(id_root, 0., True)
    for i in (1, 2, 4): assert not torch.allclose(frozen[i], launched[i], rtol=0, atol=tols[i-1])
    # the learner exports and predicts as fastai's (no compiled module in it)
    graphed[0].export(tmp_path/'graphs.pkl')
    from fastai.learner import load_learner
    assert type(load_learner(tmp_path/'graphs.pkl', cpu=False).model) is nn.Sequential

class Stop(Callback):
    "Ends training at its 4th batch with `ex` (an error escaping `fit`, or fastai's cancellation of the epoch)"
    def __init__(self, ex): self.ex = ex
    def after_batch(self):
        if self.training and self.iter == 3: raise self.ex

@pytest.mark.skipif(DEVICE == 'cpu', reason='CUDA graphs need a GPU: the GPU suite runs this')
@pytest.mark.parametrize('ex', [KeyboardInterrupt(), CancelEpochException()], ids=['interrupt', 'cancel'])  # (an error ends as an interrupt)
def test_cuda_graphs_give_the_model_back(id_root, ex):
    "However training ends, `learn.model` is the model itself (`save`, `export` and `SaveModelCallback` never see `_orig_mod.`)"
    dls = DaliDataLoaders.from_folder(id_root, item_tfms=Resize(8), bs=6, device=DEVICE, shuffle=False)
    seen = []
    class Keys(Callback):
        order = 99
        def after_epoch(self): seen.append(next(iter(self.learn.model.state_dict())))
    learn = Learner(dls, small_cnn(dls.c).cuda(), opt_func=ForeachAdam, cbs=[CudaGraphCallback(), Keys()])
    model = learn.model
    try:
        with learn.no_bar(): learn.fit(2, cbs=Stop(ex))
    except KeyboardInterrupt: pass
    assert learn.model is model and all(not k.startswith('_orig_mod') for k in seen), seen
    with learn.no_bar(): learn.fit(1)  # and trains again
    assert learn.model is model

@pytest.mark.skipif(DEVICE == 'cpu', reason='a host sync is a GPU matter: the GPU suite runs this')
def test_no_host_sync_in_a_graphed_training_batch(id_root):
    s = SyncsInBatch()
    dls = DaliDataLoaders.from_folder(id_root, item_tfms=Resize(8), bs=6, device=DEVICE, shuffle=False)
    learn = Learner(dls, small_cnn(dls.c).cuda(), opt_func=ForeachAdam, cbs=[s, DeviceLossCallback(), CudaGraphCallback()])
    with learn.no_bar(): learn.fit(1)  # compiled, recorded (torch.compile's own work, not a training batch's)
    with learn.no_bar(): learn.fit(2)  # every batch a replay: the gradients exist
    assert s.per_batch == [0]*len(s.per_batch), s.per_batch

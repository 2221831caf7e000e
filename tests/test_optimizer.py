"""`ForeachAdam` / `ForeachSGD` (04b_optimizer) with `DaliDataLoaders`, as a user trains: the same parameters as fastai's
own optimizer after `fine_tune` of a `vision_learner` (frozen body with `train_bn`, then unfrozen, discriminative rates),
and `learn.export` / `load_learner` / `predict` with the optimizer's `opt_func` given by name (the fast path's twin of fastai's
optimizer pickles as fastai's: test_export.py).

The numbers compared: on the CPU backend the two trainings are equal to the bit (the foreach operations are fastai's
operations tensor by tensor there); on a GPU the multi-tensor kernels may round differently from the per-tensor ones, so
the parameters are compared against the difference two runs of fastai's own optimizer already show (cuDNN's
convolutions are not deterministic), with a margin.
"""
import pickle
import pytest, torch
from fastai.vision.all import vision_learner, resnet18, Resize, Adam, RAdam, SGD, set_seed, load_learner, accuracy
from fastai_dali.data import DaliDataLoaders
from fastai_dali.samples import make_image_folder
from fastai_dali.optimizer import ForeachAdam, ForeachRAdam, ForeachSGD, ForeachOptimizer
from conftest import DEVICE

@pytest.fixture(scope='module')
def root(tmp_path_factory): return make_image_folder(tmp_path_factory.mktemp('opt'), 24, 8, min_size=40, max_size=64, seed=5)

@pytest.fixture(autouse=True)
def _cudnn_as_it_was(monkeypatch):
    "fastai's `set_seed(reproducible=True)` (below) sets cuDNN's flags for the whole process: put back after each test, so that no later test depends on this file having run"
    for k in ('deterministic', 'benchmark'): monkeypatch.setattr(torch.backends.cudnn, k, getattr(torch.backends.cudnn, k))

def fine_tuned(root, opt_func, **kw):
    set_seed(0, reproducible=True)
    dls = DaliDataLoaders.from_folder(root, item_tfms=Resize(32), bs=8, device=DEVICE, seed=0)
    dls.fast_path = False  # the optimizer asked for, fastai's own included (not the fast path's twin of it)
    learn = vision_learner(dls, resnet18, pretrained=False, opt_func=opt_func, metrics=accuracy, **kw)
    with learn.no_bar(), learn.no_logging(): learn.fine_tune(1, 1e-3, freeze_epochs=1)
    return learn, [p.detach().float().cpu().clone() for p in learn.model.parameters()]

def rel(a, b): return max(((p-q).abs().max()/q.abs().max().clamp_min(1e-12)).item() for p,q in zip(a, b))

# RAdam: 12 steps an epoch here, so its momentum steps (r <= 5, the first 5) and rectified ones are both taken
@pytest.mark.parametrize('ours,theirs', [(ForeachAdam, Adam), (ForeachSGD, SGD), (ForeachRAdam, RAdam)],
                         ids=['adam', 'sgd', 'radam'])
def test_fine_tune_as_fastai(root, ours, theirs):
    kw = dict(wd=0.1) if ours is ForeachSGD else {}
    learn,got = fine_tuned(root, ours, **kw)
    assert isinstance(learn.opt, ForeachOptimizer)
    _,want = fine_tuned(root, theirs, **kw)
    if DEVICE == 'cpu': assert rel(got, want) == 0.
    else:
        _,again = fine_tuned(root, theirs, **kw)
        noise = rel(again, want)
        print(f"relative difference: {rel(got, want):.2e}, fastai against itself: {noise:.2e}")
        assert rel(got, want) <= max(10*noise, 1e-4), (rel(got, want), noise)

def test_export_predict(root, tmp_path):
    learn,_ = fine_tuned(root, ForeachAdam)
    f = learn.dls.valid_ds.items[0]
    want = learn.predict(f)
    learn.export(tmp_path/'export.pkl')
    learn2 = load_learner(tmp_path/'export.pkl', cpu=DEVICE == 'cpu')
    assert learn2.opt_func is ForeachAdam   # given by name (not the fast path's twin, which pickles as fastai's `Adam`)
    learn2.dls = DaliDataLoaders.from_dls(learn2.dls)   # DALI's loaders again (the exported ones are fastai's: PIL)
    got = learn2.predict(f)
    assert got[0] == want[0] and torch.allclose(got[2].cpu(), want[2].cpu(), atol=1e-5 if DEVICE == 'cpu' else 2e-3)
    learn2.dls = learn.dls   # trains on after loading, with its state created afresh
    with learn2.no_bar(), learn2.no_logging(): learn2.fit(1, 1e-4)
    assert isinstance(learn2.opt, ForeachOptimizer) and all(s.get('step') for s in learn2.opt.state_dict()['state'][-2:])

@pytest.mark.skipif(DEVICE != 'cpu', reason='the script is the GPU measurement (bf16); here its fp32 check on the CPU backend')
def test_losses_script_equal_on_the_cpu(tmp_path):
    "`scripts/optimizer_losses.py` (fastai's Adam against itself and ForeachAdam, batch by batch): all equal in fp32 here"
    import importlib.util, json
    from pathlib import Path
    spec = importlib.util.spec_from_file_location('optimizer_losses', Path(__file__).parents[1]/'scripts'/'optimizer_losses.py')
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    mod.main([str(tmp_path), '--device', 'cpu', '--n', '40', '--bs', '8', '--size', '32', '--runs', '2'])
    res = json.loads((tmp_path/'optimizer_losses.json').read_text())
    assert res['settings']['batches'] == 4 and len(res['fastai'][0]['batch_losses']) == 4, res['settings']
    assert res['gaps'] == {k: dict(max=0., mean=0., valid=0.) for k in ("fastai's Adam, run 2", 'ForeachAdam, run 1')}
    assert res['within_noise'] and len({r['batch_losses'][0] for r in res['fastai'] + res['foreach']}) == 1
    assert '| ForeachAdam, run 1 ' in (tmp_path/'optimizer_losses.md').read_text()

"""The GPU tests of `StepGraphCallback` (tests/test_step_graph.py) run on the CPU, the CUDA graph replaced by the
notebook's stand-in (each replay runs the captured step again, writing into the same outputs): their counts and
lifecycle checked without a GPU.    python scripts/step_graph_on_cpu.py"""
import sys, torch, tempfile
sys.path.insert(0, 'tests')
from _pytest.monkeypatch import MonkeyPatch
torch.nn.Module.cuda = lambda self, *a, **k: self
import fastai_dali.graphs as SG
class Replayed:
    def __init__(self, step): self.step,self.rec = step,None
    def replay(self):
        pred,loss = self.step()
        if self.rec.pred is None: self.rec.pred,self.rec.loss = pred.detach().clone(),loss.detach().clone()
        else: self.rec.pred.copy_(pred.detach()); self.rec.loss.copy_(loss.detach())
SG.StepGraphCallback._can_capture = lambda self, p: True
def _record(self, step, grads):
    with torch.no_grad():
        for p in grads: p.grad = torch.zeros_like(p)
    return Replayed(step),None,None
SG.StepGraphCallback._record = _record
orig = SG.StepGraphCallback._capture
def _capture(self, xs, ys):
    g = orig(self, xs, ys); g.graph.rec = g; return g
SG.StepGraphCallback._capture = _capture
import test_step_graph as T
from fastai_dali.bench_gpus import id_folder
root = id_folder(tempfile.mkdtemp())
for bf16 in (False,):
    mp = MonkeyPatch(); T.test_step_graph_trains_as_fastai(root, mp, bf16); mp.undo(); print('trains_as_fastai ok', bf16)
mp = MonkeyPatch(); T.test_step_graph_compiled_optimizer(root, mp); mp.undo(); print('compiled optimizer ok')
T.test_step_graph_fine_tune_lr_find_interrupted(root); print('fine_tune/lr_find/interrupted ok')
torch.cuda.set_sync_debug_mode = lambda *a: None
T.test_no_host_sync_in_a_replayed_batch(root); print('no host sync (counts) ok')

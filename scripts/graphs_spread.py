"""How far apart fits of the GPU suite's small CNN land (`tests/test_training.py`'s `graphs_run`): the model itself twice,
compiled without graphs twice, as CUDA graphs twice, graphed with lr 0 once (the control); with inductor choosing its
kernels' configs by timing them (its default) and without (`torch._inductor.config.deterministic`). Each distance is
the largest |difference| of the batch losses, the valid records, the predictions and the weights. The CUDA-graph
test's tolerances come from these (H200: docs/results/gpu_suite/h200_graphs_spread.json).
Usage (GPU): python scripts/graphs_spread.py OUT.json"""
import sys, os, json, tempfile
from pathlib import Path
sys.path.insert(0, 'tests')
os.environ.setdefault('FASTAI_DALI_TEST_DEVICE', 'cuda')
import torch
import torch._inductor.config as inductor
from conftest import make_id_folder
import test_training as tt
root = make_id_folder(Path(tempfile.mkdtemp()))
torch.backends.cudnn.deterministic = True
compile = torch.compile
def launched_run():
    torch.compile = lambda model, mode=None, **kw: compile(model, mode='default', **kw)
    try: return tt.graphs_run(root, 1e-2, True)
    finally: torch.compile = compile
names = ['losses', 'values', 'preds', 'weights']
def d(a, b): return [float((x - y).abs().max()) for x,y in zip(a[1:], b[1:])]
out = {}
for det in (False, True):
    inductor.deterministic = det
    torch._dynamo.reset()
    E1,E2 = tt.graphs_run(root, 1e-2, False), tt.graphs_run(root, 1e-2, False)
    L1,L2 = launched_run(), launched_run()
    G1,G2 = tt.graphs_run(root, 1e-2, True), tt.graphs_run(root, 1e-2, True)
    F = tt.graphs_run(root, 0., True)
    r = {'E1-E2': d(E1,E2), 'L1-L2': d(L1,L2), 'G1-G2': d(G1,G2), 'G1-L1': d(G1,L1), 'G2-L2': d(G2,L2), 'L1-E1': d(L1,E1),
         'G1-E1': d(G1,E1), 'F-L1': d(F,L1), 'scale': [float(x.abs().max()) for x in L1[1:]]}
    out[f'inductor deterministic={det}'] = r
    print(f'inductor deterministic={det}', names); [print(f'  {k}: ' + ' '.join(f'{v:.2e}' for v in vs)) for k,vs in r.items()]
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))

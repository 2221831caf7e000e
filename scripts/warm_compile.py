"""What `StepGraphCallback()`'s compiles cost a process whose torch compile caches are already warm (a second run of a
script): the model's forward and backward (`torch.compile(model)`) and fastai's optimizer step (`bucket_step`, compiled
once per bucket of the plan: one per parameter group of `vision_learner`'s splitter; and, to compare, the same buckets
through one compiled function, one graph), each in a new process, first with empty caches (cold) then again (warm).
Prints a JSON line a part and a run: seconds of the first call, the second, and torch's own counters (graphs, cache
hits) and phase times.

    python scripts/warm_compile.py OUT [DEVICE] [ARCH]     (DEVICE cpu or cuda, default cuda when there is one; ARCH resnet18)

The caches go to a folder of their own in the temporary folder, emptied first. Writes OUT/warm_compile_DEVICE_ARCH.jsonl.
"""
import json, os, subprocess, sys, tempfile

def all_buckets(buckets):
    "Every bucket of a plan through `bucket_step` (each its arguments, as `device_step` gives them), in one function: what one compile makes one graph of"
    from fastai_dali.optimizer import bucket_step
    for a in buckets: bucket_step(*a)

def part(which, device, arch):
    "In this process: `which` ('model', 'optimizer' or 'optimizer, one graph') compiled and called twice on `device`; a dict of its figures"
    import time, torch
    from fastai.vision.all import create_vision_model, model_meta
    import torchvision.models as tvm
    from fastai_dali.optimizer import ForeachAdam, bucket_step
    from fastai_dali.graphs import _own_copy
    a = getattr(tvm, arch)
    m = create_vision_model(a, 10, pretrained=False).to(device)
    sync = torch.cuda.synchronize if device == 'cuda' else (lambda: None)
    x,y = torch.randn(16, 3, 64, 64, device=device),torch.randint(0, 10, (16,), device=device)
    if which == 'model':
        cm = torch.compile(m)
        def call(): torch.nn.functional.cross_entropy(cm(x), y).backward()
    else:
        opt = ForeachAdam(model_meta[a]['split'](m), lr=1e-3)
        for p in m.parameters(): p.grad = torch.randn_like(p)
        if which == 'optimizer':
            b = torch.compile(_own_copy(bucket_step))
            def call(): opt.device_numbers(); opt.device_step(bucket=b)
        else:
            f = torch.compile(all_buckets)
            @torch.no_grad()
            def call():   # (`device_step` gathers each bucket's arguments; the compiled function runs them all)
                opt.device_numbers(); buckets = []
                opt.device_step(bucket=lambda *a: buckets.append(a)); f(buckets)
    ts = []
    for _ in range(2): sync(); t = time.perf_counter(); call(); sync(); ts.append(round(time.perf_counter()-t, 3))
    from torch._dynamo.utils import compile_times, counters
    res = dict(part=which, first_s=ts[0], second_s=ts[1],
               counters={k: dict(v) for k,v in counters.items() if k in ('stats', 'inductor', 'aot_autograd') and v},
               phases=compile_times(repr='str', aggregate=True).splitlines()[2:8])
    if which != 'model': res['buckets'] = [len(q) for _,q,_,_ in opt._plan()]
    return res

def main(out, device=None, arch='resnet18'):
    import torch
    device = device or ('cuda' if torch.cuda.is_available() else 'cpu')
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tempfile.gettempdir(), 'warm_compile_inductor_cache'))
    subprocess.run(['rm', '-rf', env['TORCHINDUCTOR_CACHE_DIR']])
    res = []
    for run in ('cold', 'warm'):
        for which in ('model', 'optimizer', 'optimizer, one graph'):
            code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); from warm_compile import part; "
                    f"print('PART ' + json.dumps(part({which!r}, {device!r}, {arch!r})))")
            p = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env)
            line = next((l[5:] for l in p.stdout.splitlines() if l.startswith('PART ')), None)
            if line is None: print(f'{run} {which}: failed\n{p.stderr[-3000:]}', flush=True); continue
            o = dict(run=run, device=device, arch=arch, **json.loads(line)); res.append(o); print(json.dumps(o), flush=True)
    with open(os.path.join(out, f'warm_compile_{device}_{arch}.jsonl'), 'w') as f: f.writelines(json.dumps(o) + '\n' for o in res)
    return res

if __name__ == '__main__':
    a = sys.argv[1:]
    if not a: sys.exit(__doc__)
    main(a[0], a[1] if len(a) > 1 else None, a[2] if len(a) > 2 else 'resnet18')

"""First-epoch losses of `learn.fit_one_cycle` in bf16 with fastai's `Adam` and with `ForeachAdam` (04b_optimizer),
against the run-to-run noise of fastai's own: the same data order, the same initial weights, the same schedule.

    python scripts/optimizer_losses.py OUT [--device cuda] [--n 2000] [--arch resnet18] [--bs 64] [--size 128]
                                           [--epochs 1] [--runs 3] [--graphs]

Every run: `set_seed(0)`, a randomly initialised `arch` (the bench's Learner: bf16 and channels_last on the GPU),
`fit_one_cycle(epochs, 1e-3)` on DaliDataLoaders (seed 0) of a generated folder (`make_bench_dataset`), recording each
training batch's loss (that batch's, not the smoothed one; kept on the device until the epoch ends) and the valid loss.
fastai's `Adam` runs `--runs` times: how far its runs fall from its first is the noise (cuDNN's convolutions are not
deterministic, and bf16 rounds what they sum). `ForeachAdam` runs `--runs - 1` times and is compared with the same first
run. With `--graphs` (a GPU), `ForeachAdam` with `CudaGraphCallback` (training batches as CUDA graphs: compiled
kernels sum in another order, so not to the bit) runs `--runs - 1` times too, against the same first run, and fastai's
`Adam` once in fp32: how far bf16 itself moves the losses, the scale to read a compiled model's differences against.
Writes OUT/optimizer_losses.json and OUT/optimizer_losses.md, and prints the table.
On the CPU (fp32, deterministic) the runs of each optimizer are equal to the bit, and `ForeachAdam`'s equal to fastai's.
"""
import argparse, json, sys, time
from pathlib import Path
import torch
from fastai.vision.all import Resize, Normalize, imagenet_stats, set_seed, models, Callback
from fastai_dali.data import DaliDataLoaders
from fastai_dali.optimizer import ForeachAdam
from fastai_dali.graphs import CudaGraphCallback
from fastai_dali.bench import bench_learner, md_table
from fastai_dali.samples import make_bench_dataset

class BatchLosses(Callback):
    "Each training batch's loss, kept on the device (`losses`, a list of 0-d tensors) and copied once, after the fit"
    order = 60
    def before_fit(self): self.losses = []
    def after_loss(self):
        if self.training: self.losses.append(self.loss.detach().float())

def run(root, arch, opt_func, args, cbs=(), bf16=None):
    "One seeded training (with `cbs`; bf16 on the GPU unless `bf16=False`): its batch losses and the valid loss after each epoch"
    set_seed(0)  # the same weights and data order; cuDNN left to choose its kernels, as fastai's default leaves it
    dls = DaliDataLoaders.from_folder(root, item_tfms=Resize(args.size), batch_tfms=Normalize.from_stats(*imagenet_stats),
                                      bs=args.bs, device=args.device, seed=0)
    gpu = args.device != 'cpu'
    learn = bench_learner(dls, arch, dls.c, bf16=gpu if bf16 is None else bf16, channels_last=gpu, opt_func=opt_func)
    cb = BatchLosses()
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(args.epochs, 1e-3, cbs=[cb, *cbs])
    return dict(batch_losses=torch.stack(cb.losses).cpu().tolist(), valid_loss=float(learn.recorder.values[-1][1]))

def gap(a, b):
    "max and mean |a - b| over the batches two runs share, and |valid a - valid b|"
    d = (torch.tensor(a['batch_losses']) - torch.tensor(b['batch_losses'])).abs()
    return dict(max=d.max().item(), mean=d.mean().item(), valid=abs(a['valid_loss'] - b['valid_loss']))

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('out'); p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--n', type=int, default=2000); p.add_argument('--arch', default='resnet18')
    p.add_argument('--bs', type=int, default=64); p.add_argument('--size', type=int, default=128)
    p.add_argument('--epochs', type=int, default=1); p.add_argument('--runs', type=int, default=3)
    p.add_argument('--graphs', action='store_true', help='also ForeachAdam with CudaGraphCallback, and fastai in fp32 (a GPU)')
    args = p.parse_args(argv)
    if args.graphs and args.device == 'cpu': p.error('--graphs needs a GPU (CUDA graphs)')
    if args.runs < 2: p.error('--runs must be at least 2 (fastai against itself is the noise)')
    out = Path(args.out); out.mkdir(parents=True, exist_ok=True)
    root,arch = make_bench_dataset(out/f'data_{args.n}', args.n),getattr(models, args.arch)
    t = time.perf_counter()
    fastai_runs = [run(root, arch, None, args) for _ in range(args.runs)]
    ours = [run(root, arch, ForeachAdam, args) for _ in range(args.runs - 1)]
    graphs = [run(root, arch, ForeachAdam, args, cbs=[CudaGraphCallback()]) for _ in range(args.runs - 1 if args.graphs else 0)]
    fp32 = [run(root, arch, None, args, bf16=False)] if args.graphs else []
    first = fastai_runs[0]
    rows = ([(f"fastai's Adam, run {i+2}", g) for i,g in enumerate(gap(r, first) for r in fastai_runs[1:])] +
            [(f'ForeachAdam, run {i+1}', g) for i,g in enumerate(gap(r, first) for r in ours)] +
            [(f'ForeachAdam + CudaGraphCallback, run {i+1}', g) for i,g in enumerate(gap(r, first) for r in graphs)] +
            [("fastai's Adam in fp32 (what bf16 itself moves)", gap(r, first)) for r in fp32])
    noise = max(g['max'] for k,g in rows if k.startswith("fastai's Adam, run"))
    res = dict(settings={**vars(args), 'precision': 'bf16' if args.device != 'cpu' else 'fp32',
                         'torch': torch.__version__, 'seconds': round(time.perf_counter() - t, 1),
                         'batches': len(first['batch_losses']),
                         'gpu': torch.cuda.get_device_name() if args.device != 'cpu' else None},
               fastai=fastai_runs, foreach=ours, graphs=graphs, fp32=fp32, gaps={k: g for k,g in rows}, noise_max=noise,
               within_noise=all(g['max'] <= noise for k,g in rows if k.startswith('ForeachAdam, ')))
    head = ['against fastai\'s Adam, run 1', 'batch losses: max \\|Δ\\|', 'mean \\|Δ\\|', 'valid loss \\|Δ\\|']
    md = md_table(head, [[k, f"{g['max']:.2e}", f"{g['mean']:.2e}", f"{g['valid']:.2e}"] for k,g in rows], right=(1, 2, 3))
    md += (f"\n\n{res['settings']['batches']} training batches, {args.arch}, bs {args.bs}, {args.size} px, "
           f"{res['settings']['precision']}, {args.device}; first run: mean batch loss "
           f"{sum(first['batch_losses'])/len(first['batch_losses']):.4f}, valid loss {first['valid_loss']:.4f}. "
           f"ForeachAdam within fastai's own run-to-run spread (max \\|Δ\\| ≤ {noise:.2e}): {res['within_noise']}\n")
    (out/'optimizer_losses.json').write_text(json.dumps(res, indent=1))
    (out/'optimizer_losses.md').write_text(md)
    print(md)

if __name__ == '__main__': sys.exit(main())

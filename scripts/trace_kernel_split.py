"""GPU time per training batch by kind of kernel in chrome traces of `fit_trace` (`fastai_dali.bench.training`):
cuDNN/cuBLAS (convolutions, matmuls), Triton (the kernels `torch.compile` generated), DALI's, the foreach kernels
(optimizer step, zero_grad), the rest (the largest of those named).

    python scripts/trace_kernel_split.py BATCHES TRACE.json.gz [...]
"""
import collections, gzip, json, sys

def kind(name):
    n = name.lower()
    if 'multi_tensor_apply' in n or 'foreach' in n: return 'foreach (optimizer step, zero_grad)'
    if 'triton' in n: return 'triton (torch.compile: forward and backward)'
    if 'dali' in n or 'nvjpeg' in n or 'resize' in n or 'jpeg' in n: return "DALI's"
    if any(s in n for s in ('cudnn', 'xmma', 'sm90', 'cutlass', 'gemm', 'conv')): return 'cuDNN / cuBLAS (convolutions, matmuls)'
    return 'other'

def split(fn, batches):
    ev = [e for e in json.load(gzip.open(fn))['traceEvents'] if e.get('cat') == 'kernel' and e.get('ph') == 'X']
    ms,n,other = collections.Counter(),collections.Counter(),collections.Counter()
    for e in ev:
        k = kind(e['name']); ms[k] += e['dur']/1000/batches; n[k] += 1/batches
        if k == 'other': other[e['name'][:100]] += e['dur']/1000/batches
    return ms,n,other

if __name__ == '__main__':
    batches = int(sys.argv[1])
    for fn in sys.argv[2:]:
        ms,n,other = split(fn, batches)
        print(f'{fn}: {sum(ms.values()):.2f} ms of kernels a batch')
        for k,v in ms.most_common(): print(f'  {k:45s} {v:6.2f} ms  {n[k]:6.1f} kernels')
        for k,v in other.most_common(4): print(f'      {v:6.3f} ms  {k}')

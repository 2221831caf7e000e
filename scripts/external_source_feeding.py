"""DALI's parallel external_source fed per sample (a list of arrays per batch: Python per sample in the main thread) or
per batch (one padded array and the lengths, cut back by `fn.slice`: what `EpochSource` does), on the CPU backend:
img/s and the main thread's own CPU time per batch (`time.thread_time`, waits excluded), 3 epochs after a warm-up one.
Run: `python scripts/external_source_feeding.py` (2,048 random 40-120 KB arrays, bs 128, 2 worker processes)."""
import numpy as np, time, sys
from nvidia.dali import pipeline_def, fn, types
N, BS = 2048, 128
rng = np.random.default_rng(0)
data = [rng.integers(0, 255, int(rng.integers(40_000, 120_000)), dtype=np.uint8) for _ in range(N)]
class PerSample:
    def __call__(self, si):
        if si.idx_in_epoch >= N: raise StopIteration
        i = si.idx_in_epoch; return data[i], np.array(i, np.int64)
class PerBatch:
    def __call__(self, bi):
        s = bi.iteration*BS
        if s >= N: raise StopIteration
        xs = data[s:s+BS]; L = np.array([len(x) for x in xs], np.int32)
        P = np.zeros((len(xs), L.max()), np.uint8)
        for r,x in zip(P, xs): r[:len(x)] = x
        return P, L[:, None], np.arange(s, s+len(xs), dtype=np.int64)
@pipeline_def(batch_size=BS, num_threads=2, device_id=None, py_num_workers=2, py_start_method='spawn')
def p_sample():
    j,y = fn.external_source(PerSample(), num_outputs=2, batch=False, parallel=True, dtype=[types.UINT8, types.INT64])
    return fn.slice(j, start=[0], shape=[1000], axes=[0]), y
@pipeline_def(batch_size=BS, num_threads=2, device_id=None, py_num_workers=2, py_start_method='spawn')
def p_batch():
    p,l,y = fn.external_source(PerBatch(), num_outputs=3, batch=True, batch_info=True, parallel=True, prefetch_queue_depth=2, dtype=[types.UINT8, types.INT32, types.INT64])
    j = fn.slice(p, start=[0], shape=l, axes=[0])
    return fn.slice(j, start=[0], shape=[1000], axes=[0]), y
def run(pp, eps=4):
    pp.build(); ts=[]
    for ep in range(eps):
        t=time.perf_counter(); c=time.thread_time(); n=0
        try:
            while True: pp.run(); n+=1
        except StopIteration: pp.reset()
        ts.append((round(N/(time.perf_counter()-t)), round(1e3*(time.thread_time()-c)/n, 2)))
    return ts
if __name__ == '__main__':
    for name,f in (('per sample', p_sample), ('per batch', p_batch)):
        pp = f(); run(pp, 1)
        print(name, '(img/s, main thread CPU ms per batch)', run(pp, 3), flush=True)

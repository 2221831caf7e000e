"""Two chrome traces of graphed training (torch.profiler, e.g. `graphs_without_compile.py`'s `plain_whole_step_fastai_adam`
and `step_graph_synthetic`) side by side, a batch each: the kernels inside the replayed graph and outside it, by name
(count and µs a batch in each, the difference), and what each stream does between replays (`between_replays` of
`step_graph_loader.py`). Where one loop's batch takes longer than the other's, this says whether it is the graph's
kernels (another kernel, or the same one slower) or the time between the graphs.

    python scripts/trace_diff.py A.json.gz B.json.gz [BATCHES] [TOP]   (BATCHES: each trace's replays, default: counted)
"""
import gzip, json, sys
from fastai_dali.bench.traces import between_replays, graph_kernels as kernels, kernel_diff as diff

def main(fa, fb, batches=None, top='15'):
    ea,eb = (json.load(gzip.open(f))['traceEvents'] for f in (fa, fb))
    (ia,oa,na),(ib,ob,nb) = kernels(ea),kernels(eb)
    if batches: na = nb = int(batches)
    print(f'A: {fa} ({na} replays)\nB: {fb} ({nb} replays)')
    for what,a,b in (('inside the graph', ia, ib), ('outside it', oa, ob)):
        ta,tb = sum(v[1] for v in a.values())/max(1, na),sum(v[1] for v in b.values())/max(1, nb)
        ca,cb = sum(v[0] for v in a.values())/max(1, na),sum(v[0] for v in b.values())/max(1, nb)
        print(f'\n## {what}: A {ta:,.0f} µs in {ca:.0f} kernels a batch, B {tb:,.0f} µs in {cb:.0f}\n')
        print('| kernel | A n | B n | A µs | B µs | B - A µs |\n|---|---:|---:|---:|---:|---:|')
        for k,*r in diff(a, b, max(1, na), max(1, nb), int(top)): print(f'| `{k}` | {r[0]:.1f} | {r[1]:.1f} | {r[2]:,.1f} | {r[3]:,.1f} | {r[4]:+,.1f} |')
    print('\n## between the replays (ms a batch)\n')
    ba,bb = between_replays(ea, na),between_replays(eb, nb)
    for k in ('gap_ms', 'graph_stream_work_between_ms', 'launch_to_first_kernel_median_ms', 'graph_launch_call_ms'):
        print(f'- {k}: A {ba.get(k)}, B {bb.get(k)}')
    print(f"- stalls: A {ba.get('stalls')}, B {bb.get('stalls')}")

if __name__ == '__main__': main(*sys.argv[1:])

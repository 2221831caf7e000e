"""Two chrome traces of graphed training (torch.profiler, e.g. `graphs_without_compile.py`'s `plain_whole_step_fastai_adam`
and `step_graph_synthetic`) side by side, a batch each: the kernels inside the replayed graph and outside it, by name
(count and µs a batch in each, the difference), and what each stream does between replays (`between_replays` of
`step_graph_loader.py`). Where one loop's batch takes longer than the other's, this says whether it is the graph's
kernels (another kernel, or the same one slower) or the time between the graphs.

    python scripts/trace_diff.py A.json.gz B.json.gz [BATCHES] [TOP]   (BATCHES: each trace's replays, default: counted)
"""
import collections, gzip, json, os, re, sys
sys.path.insert(0, os.path.dirname(__file__))
from step_graph_loader import between_replays

def norm(name):
    "A kernel's name without what differs from one compilation to the next (Triton's numbered kernels, template arguments)"
    n = re.sub(r'_\d+$', '', name.split('(')[0])
    return re.sub(r'<.*', '<…>', n)[:90]

def kernels(events):
    "({name: (count, µs)} of the kernels the graph launches replayed, the same of the others, the number of replays)"
    launch = {e['args']['correlation'] for e in events if e.get('cat') == 'cuda_runtime' and e.get('name') == 'cudaGraphLaunch'}
    inside,outside = collections.defaultdict(lambda: [0, 0.]),collections.defaultdict(lambda: [0, 0.])
    for e in events:
        if e.get('cat') not in ('kernel', 'gpu_memcpy', 'gpu_memset'): continue
        d = inside if e.get('args', {}).get('correlation') in launch else outside
        k = d[norm(e['name'])]; k[0] += 1; k[1] += e['dur']
    return inside,outside,len(launch)

def diff(a, b, na, nb, top):
    "Rows (name, count a batch in a, in b, µs a batch in a, in b, b - a), the largest differences first"
    rows = [(k, a[k][0]/na, b[k][0]/nb, a[k][1]/na, b[k][1]/nb, b[k][1]/nb - a[k][1]/na) for k in set(a) | set(b)]
    return sorted(rows, key=lambda r: -abs(r[-1]))[:top]

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

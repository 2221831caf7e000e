"""The main thread's active samples in the timed loop of `scripts/targets_epochs.py`, from py-spy's raw output
(`--threads --format raw`, active samples only): the share of each step of the loader, and what the targets' host work
(`TargetPlan.batch`) spends its samples on.

    python scripts/py_spy_summary.py spy_labels.txt spy_points.txt spy_boxes.txt

`main_thread_steps(path, loop)` reads a record of any loop over a `DaliDL` (`--subprocesses` too: each process's
samples apart), e.g. `scripts/gpu_results.sh shards-trace`'s: where the main thread is in each batch, and what DALI's
worker processes spend their samples on.
"""
import collections, re, sys

def summary(path, loop='targets_epochs.py:'):
    steps,host,tot = collections.Counter(),collections.Counter(),0
    lines = [l.rsplit(' ', 1) for l in open(path) if l.strip()]
    line_no = _loop_line(lines, loop)
    for stack,n in lines:
        procs,fr = _split(stack); n = int(n)
        if len(procs) > 1 or 'MainThread' not in fr[0] or not any(f'{loop}{line_no})' in f for f in fr): continue
        names = [re.sub(r' \(.*', '', f) for f in fr]
        i = names.index('DaliDL.__iter__') if 'DaliDL.__iter__' in names else None
        steps[' > '.join(names[i+1:i+3]) if i is not None else 'the loop itself'] += n; tot += n
        if 'TargetPlan.batch' in names:
            j = names.index('TargetPlan.batch'); host[' > '.join(names[j+1:j+3]) or 'its own lines'] += n
    return tot,steps,host

def _split(stack):
    "A raw stack's process frames (`--subprocesses`: the main process, then a child's) and the rest (the thread, its frames)"
    fr,procs = stack.split(';'),[]
    while fr and fr[0].startswith('process '): procs.append(fr.pop(0))
    return procs,fr

def main_thread_steps(path, loop, top=10):
    "Print the main thread's samples in `loop` (a function's name, or a file name and colon: its busiest line) by where they are under `DaliDL.__iter__`, and each child process's"
    lines = [l.rsplit(' ', 1) for l in open(path) if l.strip()]
    line_no,main,kids,tot = _loop_line(lines, loop) if loop.endswith(':') else '',collections.Counter(),collections.defaultdict(collections.Counter),0
    where = f'{loop}{line_no})' if line_no else f'{loop} ('
    inside = lambda fr: any(where in f for f in fr) if line_no else any(f.startswith(where) for f in fr)
    for stack,n in lines:
        procs,fr = _split(stack); n = int(n)
        names = [re.sub(r' \(.*', '', f) for f in fr[1:]]
        if len(procs) > 1: kids[procs[1].split('"')[0]][' > '.join(names[-2:])] += n; continue
        if 'MainThread' not in fr[0] or not inside(fr) or 'DaliDL.__iter__' not in names: continue
        i = names.index('DaliDL.__iter__'); tot += n
        main[' > '.join(names[i+1:i+4]) + ' ... ' + names[-1]] += n
    print(f'{path}: {tot} samples of the main thread in the loop ({loop}{line_no})')
    for k,v in main.most_common(top): print(f'  {v:7d} {v/max(tot,1):6.1%}  {k}')
    for p,c in sorted(kids.items(), key=lambda kv: -sum(kv[1].values()))[:top]:
        print(f'  child {p}: {sum(c.values())} samples; ' + ', '.join(f'{k} {v}' for k,v in c.most_common(3)))

def _loop_line(lines, loop):
    "The line of the timed loop: the one of `loop`'s lines with the most main-thread samples under `DaliDL.__iter__`"
    c = collections.Counter()
    for stack,n in lines:
        if len(_split(stack)[0]) > 1: continue
        m = re.search(rf'{re.escape(loop)}(\d+)\);DaliDL.__iter__', stack)
        if m and 'MainThread' in stack: c[m.group(1)] += int(n)
    return c.most_common(1)[0][0] if c else '?'

if __name__ == '__main__':
    for p in sys.argv[1:]:
        tot,steps,host = summary(p)
        print(f'{p}: {tot} active samples of the main thread in the timed epochs')
        for k,v in steps.most_common(6): print(f'  {v:6d} {v/max(tot,1):6.1%}  {k}')
        if host: print('  the targets\' host work (TargetPlan.batch):', ', '.join(f'{k} {v}' for k,v in host.most_common(5)))

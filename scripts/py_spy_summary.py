"""The main thread's active samples in the timed loop of `scripts/targets_epochs.py`, from py-spy's raw output
(`--threads --format raw`, active samples only): the share of each step of the loader, and what the targets' host work
(`TargetPlan.batch`) spends its samples on.

    python scripts/py_spy_summary.py spy_labels.txt spy_points.txt spy_boxes.txt
"""
import collections, re, sys

def summary(path, loop='targets_epochs.py:'):
    steps,host,tot = collections.Counter(),collections.Counter(),0
    lines = [l.rsplit(' ', 1) for l in open(path) if l.strip()]
    line_no = _loop_line(lines, loop)
    for stack,n in lines:
        fr,n = stack.split(';'),int(n)
        if 'MainThread' not in fr[0] or not any(f'{loop}{line_no})' in f for f in fr): continue
        names = [re.sub(r' \(.*', '', f) for f in fr]
        i = names.index('DaliDL.__iter__') if 'DaliDL.__iter__' in names else None
        steps[' > '.join(names[i+1:i+3]) if i is not None else 'the loop itself'] += n; tot += n
        if 'TargetPlan.batch' in names:
            j = names.index('TargetPlan.batch'); host[' > '.join(names[j+1:j+3]) or 'its own lines'] += n
    return tot,steps,host

def _loop_line(lines, loop):
    "The line of the timed loop: the one of `loop`'s lines with the most main-thread samples under `DaliDL.__iter__`"
    c = collections.Counter()
    for stack,n in lines:
        m = re.search(rf'{re.escape(loop)}(\d+)\);DaliDL.__iter__', stack)
        if m and 'MainThread' in stack: c[m.group(1)] += int(n)
    return c.most_common(1)[0][0] if c else '?'

if __name__ == '__main__':
    for p in sys.argv[1:]:
        tot,steps,host = summary(p)
        print(f'{p}: {tot} active samples of the main thread in the timed epochs')
        for k,v in steps.most_common(6): print(f'  {v:6d} {v/max(tot,1):6.1%}  {k}')
        if host: print('  the targets\' host work (TargetPlan.batch):', ', '.join(f'{k} {v}' for k,v in host.most_common(5)))

import json, os, statistics, subprocess, sys
rounds, steps = int(sys.argv[1]), int(sys.argv[2])
base = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
procs = {}
for name, c in (("c_entry", "1"), ("python_entry", "0")):
    env = dict(base, GRAFT_BACKENDS="torch", GRAFT_DISPATCH_C=c, OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "titan_worker.py")], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    procs[name] = p
ready = {n: json.loads(p.stdout.readline()) for n, p in procs.items()}
print(ready, flush=True)
times = {n: [] for n in procs}
for r in range(rounds):
    order = list(procs) if r % 2 == 0 else list(reversed(procs))
    for n in order:
        procs[n].stdin.write(f"step {steps}\n"); procs[n].stdin.flush()
        times[n].append(json.loads(procs[n].stdout.readline())["s"])
ratios = sorted(p / c for c, p in zip(times["c_entry"], times["python_entry"]))
q = lambda xs, f: xs[min(len(xs) - 1, int(f * len(xs)))]
out = {"rounds": rounds, "steps_per_round": steps, "ready": ready,
       "median_step_ms": {n: statistics.median(t) * 1e3 for n, t in times.items()},
       "python_over_c_step_time": {"median": statistics.median(ratios), "q25": q(ratios, .25), "q75": q(ratios, .75),
                                   "min": ratios[0], "max": ratios[-1]}}
print(json.dumps(out, indent=1))
json.dump(out, open("titan_c.json", "w"), indent=1)
for p in procs.values():
    p.stdin.close(); p.wait()

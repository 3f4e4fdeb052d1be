"""Probe, in sample, a clock term on the planner's compute part (docs/planner.md, "Where the power
cap's effect lives"): the SM clock falls with the model's compute share of the step, so the compute
features are scaled by (f(share_ref) / f(share)) ** exponent, f(share) = 1980 MHz - slope x max(0,
share - share0), the H100 constants refitted on the shares the previous fit predicts, and the H200
part derived from them. Prints in-sample step errors with and without the term; changes nothing.

    python suites/studies/scripts/clock_term_probe.py SHARE0 SLOPE_MHZ EXPONENT     (e.g. 0.38 900 0.75)
"""

import sys

import numpy as np

from parabench.plan import calibrate as C
from parabench.plan import model as M

F_MAX, S0, KAPPA, ALPHA = 1980.0, float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])


def clock(share):
    return F_MAX - KAPPA * max(0.0, share - S0)


obs = C.observations("results", "h100")
o200 = C.observations("results", "h200")
coll = C.fit_collectives("results", "h100")
att = C.fit_attention("results", "h100")
base = C.fit(obs, coll, attention_rate=att)
COMPUTE = M.TIME_PARTS["compute"]
orig = M.time_features
factor = {}


def patched(w, collectives, consts=None):
    f = orig(w, collectives, consts)
    g = factor.get(id(w))
    if g is not None:
        f = {k: (v * g if k in COMPUTE else v) for k, v in f.items()}
    return f


def shares(cal, ws):
    out = {}
    for w in ws:
        p = M.predict(w, cal, impl=False)
        out[id(w)] = p.time_s["compute"] / max(p.step_s - p.time_s.get("host_wait", 0), 1e-9)
    return out


ws = [o.workload for o in obs] + [o.workload for o in o200]
sh = shares(base, ws)
s_ref = float(np.median([sh[id(o.workload)] for o in obs if not M.waits_on_host(o.workload)]))
f_ref = clock(s_ref)
print("s_ref", round(s_ref, 3), "f_ref", f_ref)
M.time_features = patched
for _round in range(3):
    factor.clear()
    factor.update({k: (f_ref / clock(v)) ** ALPHA for k, v in sh.items()})
    cal = C.fit(obs, coll, attention_rate=att)
    sh = shares(cal, ws)


def errs(cal, ob, use):
    if not use:
        M.time_features = orig
    else:
        M.time_features = patched
    e = [100 * (M.predict(o.workload, cal).step_s / o.step_s - 1) for o in ob]
    M.time_features = patched
    return np.array(e)


def show(name, e, ob):
    hi = np.array([sh[id(o.workload)] > 0.7 for o in ob])
    print(
        f"{name:28s} median {np.median(np.abs(e)):.2f} p90 {np.percentile(np.abs(e), 90):.2f} signed {np.median(e):+.2f} | share>0.7 n={hi.sum()} median {np.median(np.abs(e[hi])) if hi.any() else 0:.1f} signed {np.median(e[hi]) if hi.any() else 0:+.1f}"
    )


show("h100 in-sample base", errs(base, obs, False), obs)
show("h100 in-sample clock", errs(cal, obs, True), obs)
d0 = C.derive(base, "h200", o200)
d1 = C.derive(cal, "h200", o200)
show("h200 derived base", errs(d0, o200, False), o200)
show("h200 derived clock", errs(d1, o200, True), o200)
print(
    {k: cal["time"][k] for k in ("inv_rate_x", "inv_mem_bw", "inv_act_bw", "host_s")},
    {k: base["time"][k] for k in ("inv_rate_x", "inv_mem_bw", "inv_act_bw", "host_s")},
)

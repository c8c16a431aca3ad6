"""Host cost of a registered operator's call with its direct kernel against
custom_op's own kernel wrapper, A/B in one process (python3
scripts/operator_host.py, a CUDA machine): µs per back-to-back call of
torch.ops.cufuse.rms_norm and norm_backward (256x2048 bfloat16), three
interleaved rounds of each, the direct kernels removed and registered again
between them (cufuse/_torch_ops.py: _custom_op; bench/NOTES.md, session 57)."""
import statistics
import time

import torch
import torch._library.custom_ops as CO
from cufuse import _torch_ops as TO
TO.register()
dt = torch.bfloat16
x = torch.randn(256, 2048, device="cuda").to(dt); w = torch.randn(2048, device="cuda").to(dt); g = torch.randn_like(x)
rn, nb = torch.ops.cufuse.rms_norm.default, torch.ops.cufuse.norm_backward.default
cases = [("rms_norm op", lambda: rn(x, [2048], w, 1e-6)), ("norm_backward op", lambda: nb("rms", g, x, 2048, w, None, 1e-6))]
def t(f, n=300):
    for _ in range(50): f()
    r = []
    for _ in range(7):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(n): f()
        r.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(r)
res = {}
for rnd in range(3):
    for mode in ("direct kernel", "custom_op wrapper"):
        if mode == "custom_op wrapper":
            TO._KERNELS[0]._destroy(); TO._KERNELS.clear()
        else:
            if not TO._KERNELS:
                TO._KERNELS.append(torch.library.Library("cufuse", "IMPL"))
                for q in ("rms_norm", "norm_backward"):
                    for key in ("CPU", "CUDA"):
                        TO._KERNELS[0].impl(q, torch._disable_dynamo(CO.OPDEFS["cufuse::" + q]._init_fn), key)
        for name, f in cases:
            res.setdefault((name, mode), []).append(t(f))
for (name, mode), v in res.items():
    print(f"A/B same process: {name:18s} {mode:18s} {statistics.median(v):6.1f} us/call (rounds {', '.join(f'{a:.1f}' for a in v)})")

"""Small attention cases for compute-sanitizer (memcheck, racecheck) on the
device: forward, backward and scores of both dtypes, odd lengths, grouped
heads, causal, masks. Run as
    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/attention_sanitize.py
(and --tool racecheck). Prints one line per case; the sanitizer reports
errors itself."""
from __future__ import annotations

import torch

import cufuse


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    for dt in (torch.float16, torch.bfloat16):
        for d, sq, sk, h, hk, causal in [(64, 77, 77, 4, 2, True), (128, 33, 130, 2, 1, False),
                                         (32, 130, 40, 2, 2, True)]:
            q = torch.randn(2, h, sq, d, device="cuda", generator=g).to(dt).requires_grad_(True)
            k = torch.randn(2, hk, sk, d, device="cuda", generator=g).to(dt).requires_grad_(True)
            v = torch.randn(2, hk, sk, d, device="cuda", generator=g).to(dt).requires_grad_(True)
            o = cufuse.attention(q, k, v, causal=causal)
            o.backward(torch.randn_like(o))
            m = torch.rand(sq, sk, device="cuda", generator=g) < 0.5
            s = cufuse.attention_score(q.detach(), k.detach(), mask=m)
            s2 = cufuse.attention_score(q.detach(), k.detach(), mask=torch.randn(sq, sk, device="cuda").to(dt))
            torch.cuda.synchronize()
            print(dt, d, sq, sk, h, hk, causal, "ok", float(o.float().abs().sum()), float(s2.float().abs().sum()),
                  int(torch.isinf(s).sum()))


if __name__ == "__main__":
    main()

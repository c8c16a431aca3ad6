"""A Llama training step timed two ways, and under CUDA graphs
(python3 scripts/train_modes.py [--dtype bfloat16] [--variants ...]): the
model of bench/model_probe.py, eager, patched (cufuse.patch), and each under
``torch.compile(mode="reduce-overhead")`` (CUDA graph trees: the host queues
a replay, not the kernels), and eager and patched with the whole step
(forward, backward, AdamW) captured in one CUDA graph (``+graph``: the
pattern of torch's "whole-network capture"; AdamW with ``capturable=True``).
Per variant, ms per step:

- synchronized: each step waited for (as bench/test_bench_models.py times it);
- pipelined: 10 steps back to back, one synchronize at the end (a training
  loop that reads its loss only at logging steps: the host queues the next
  step while the GPU runs the last one).

The AdamW step stays eager in every variant but ``+graph``. Also the first
loss of each, for a check that every variant trains the same model, and for
``+graph`` the largest difference of its losses over three steps from the same
model's uncaptured steps (a replay that did not train would differ).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import model_probe  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--variants", default="eager,cufuse,compile,compile-ro,cufuse+compile-ro,eager+graph,cufuse+graph")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fused", action="store_true", help="AdamW(fused=True) in every variant (default: foreach; "
                    "captured, foreach AdamW must be capturable, which made it 1.7x slower on an H200)")
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    base, ids, makers, module, rope = model_probe.cuda_llama(dt)
    for label in a.variants.split(","):
        graphs, captured = label.endswith("-ro"), label.endswith("+graph")
        if rope is not None:
            module.apply_rotary_pos_emb = rope  # each variant starts from transformers' own (a patch replaces it)
        torch._dynamo.reset()
        maker = makers[label[:-len("+compile-ro")] if label.endswith("+compile-ro") else
                       label[:-len("+graph")] if captured else "eager" if label == "compile-ro" else label]
        model = maker().train()
        if graphs:
            model = torch.compile(model, mode="reduce-overhead")
        adamw = dict(lr=1e-5, capturable=captured, fused=a.fused or None)
        opt = torch.optim.AdamW(model.parameters(), **adamw)
        first, drift = [], None

        def step():
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if not first:
                first.append(loss.item())
            return loss
        if captured:
            try:
                step, drift = capture(model, opt, ids, maker, first, adamw)
            except Exception as e:
                print(f"{label:18} failed to capture: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
                traceback.print_exc(limit=-8)  # where in the step: the frames nearest the error
                continue
        try:
            t0 = time.perf_counter()
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            warm = time.perf_counter() - t0
            synced, piped = [], []
            for _ in range(a.rounds):
                ts = []
                for _ in range(10):
                    t = time.perf_counter()
                    step()
                    torch.cuda.synchronize()
                    ts.append(time.perf_counter() - t)
                synced.append(statistics.median(ts))
                t = time.perf_counter()
                for _ in range(10):
                    step()
                torch.cuda.synchronize()
                piped.append((time.perf_counter() - t) / 10)
        except Exception as e:  # a variant that fails says so and the others run
            print(f"{label:18} failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            continue
        finally:
            if rope is not None:
                module.apply_rotary_pos_emb = rope
        print(f"{label:18} synchronized {1e3 * statistics.median(synced):7.2f} ms   pipelined "
              f"{1e3 * statistics.median(piped):7.2f} ms   first loss {first[0]:.4f}   warm-up {warm:5.1f} s"
              + ("" if drift is None else f"   replayed vs uncaptured losses: max diff {drift:.2e}"), flush=True)
        del model, opt, step
        torch.cuda.empty_cache()


def capture(model, opt, ids, maker, first, adamw):
    """(a function that replays ``model``'s whole training step, captured in one CUDA graph; the largest
    difference between the losses of three replays and of three uncaptured steps of a copy of the model
    from the same start). Three eager steps on a side stream come first, as torch's docs do it: they
    make the gradients, the optimizer's state and every kernel's first-call work (compiling, tables)
    before capture, where none of it may happen."""
    ref = maker().train()
    ref_opt = torch.optim.AdamW(ref.parameters(), **adamw)

    def eager(m, o):
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        o.step()
        o.zero_grad(set_to_none=True)
        return loss.detach()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            first.append(eager(model, opt).item())
            eager(ref, ref_opt)
    torch.cuda.current_stream().wait_stream(s)
    del first[1:]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # the gradients are made (set to None before), not added to
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
    drift, losses = 0.0, []
    for _ in range(3):
        g.replay()
        losses.append(loss.item())
        drift = max(drift, abs(losses[-1] - eager(ref, ref_opt).item()))
    print(f"  replayed losses {losses} (a replay that did not train would repeat one)")
    del ref, ref_opt

    def replay():
        g.replay()
        return loss
    return replay, drift


if __name__ == "__main__":
    main()

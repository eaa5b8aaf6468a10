"""Where the reference engine's time goes on a GPU (a diagnostic, not a benchmark table):

* TTFT of a host-tier hit against a recompute, with torch.profiler's top CPU ops of each;
* the attention of a suffix over a long prefix (lower-right causal), variant by variant:
  host time to launch and device time per call;
* decode tokens/s with a background save, with the save's store write-back on and off (what
  contends with the decode loop).

    python scripts/profile_e2e.py [--model llama-3.2-1b] [--tokens 16384]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

import torch
import torch.nn.functional as F

from pagekv.engine import PRESETS, Engine, EngineConfig, Request
from pagekv.engine.attention import attention
from pagekv.store import ClientConfig
from pagekv.store.launch import start_nodes


def top_ops(fn, label: str, rows: int = 18) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"--- {label}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def attention_variants(cfg: EngineConfig, t: int, s: int) -> None:
    m = cfg.model
    dev, dt = "cuda", cfg.dtype
    q = torch.randn(t, m.num_heads, m.head_dim, device=dev, dtype=dt)
    k = torch.randn(s, m.num_kv_heads, m.head_dim, device=dev, dtype=dt)
    v = torch.randn_like(k)
    rep = m.num_heads // m.num_kv_heads

    def masked():
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        keys = torch.arange(s, device=dev)
        mask = keys[None, :] <= torch.arange(s - t, s, device=dev)[:, None]
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=rep > 1)

    def split_lse():
        # prefix keys (all visible) and the last t keys (causal, square) merged by their LSE
        qh = q.transpose(0, 1).unsqueeze(0)
        kr = k.repeat_interleave(rep, dim=1) if rep > 1 else k
        vr = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (kr, vr))
        op = torch.ops.aten._scaled_dot_product_flash_attention
        o1, l1 = op(qh, kh[:, :, : s - t], vh[:, :, : s - t], 0.0, False)[:2]
        o2, l2 = op(qh, kh[:, :, s - t :], vh[:, :, s - t :], 0.0, True)[:2]
        lse = torch.logaddexp(l1, l2)
        w1, w2 = (l1 - lse).exp().unsqueeze(-1), (l2 - lse).exp().unsqueeze(-1)
        return (o1 * w1 + o2 * w2).to(q.dtype)

    def flash_gqa():
        # flash-attention's own GQA and lower-right causal mask, [B, S, H, D] as our rows lie
        op = torch.ops.aten._flash_attention_forward
        out = op(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, None, t, s, 0.0, True,
                 False)  # fmt: skip
        return out[0].squeeze(0)

    ref = attention(q, k, v).float()
    variants = [
        ("current (CausalBias + repeat)", lambda: attention(q, k, v)),
        ("bool mask + enable_gqa", masked),
        ("split + LSE merge", split_lse),
        ("flash forward, GQA, causal", flash_gqa),
    ]
    for name, fn in variants:
        try:
            out = fn()
            out = out.squeeze(0).transpose(0, 1) if out.dim() == 4 else out
            err = (out.float() - ref).abs().max().item()
        except Exception as e:  # a variant the installed torch cannot run: say so, go on
            print(f"attention {name}: unavailable ({type(e).__name__}: {e})")
            continue
        torch.cuda.synchronize()
        host, dev_ms = [], []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
            b.record()
            torch.cuda.synchronize()
            dev_ms.append(a.elapsed_time(b))
        print(f"attention {name}: host {statistics.median(host) * 1e3:.3f} ms/call, device "
              f"{statistics.median(dev_ms):.3f} ms/call, max diff {err:.4f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--question", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--decode-only", action="store_true", help="only the decode variants")
    args = ap.parse_args()
    n, qn = args.tokens, args.question
    cfg = EngineConfig(PRESETS[args.model], num_slots=n + args.decode + 64,
                       host_pages=n // 16 + 256, dtype="bf16", device="cuda")  # fmt: skip
    print(cfg.describe(), flush=True)
    gil_check()
    if not args.decode_only:
        attention_variants(cfg, qn, n)
    nodes = start_nodes(1, "--capacity", "8GiB")
    eng = Engine(cfg, ClientConfig((nodes[0].address,), timeout_s=30.0))
    gen = torch.Generator().manual_seed(7)

    def rand(k: int) -> list[int]:
        return torch.randint(0, cfg.model.vocab_size, (k,), generator=gen).tolist()

    try:
        eng.warmup(1024)
        for rep in range(0 if args.decode_only else 3):
            prefix = rand(n - qn)
            a = eng.generate(Request(prefix + rand(qn), 1, reuse=False))
            eng.flush(300)
            b = eng.generate(Request(prefix + rand(qn), 1, save=False))
            print(f"rep {rep}: recompute {a.ttft_s * 1e3:.1f} ms, host hit {b.ttft_s * 1e3:.1f} ms"
                  f" (lookup {b.lookup_s * 1e3:.2f}, prefetch {b.prefetch_s * 1e3:.2f}, load "
                  f"{b.load_s * 1e3:.2f}, stall {b.load_stall_s * 1e3:.2f}, prefill "
                  f"{b.prefill_s * 1e3:.2f} ms), reused {b.reused_tokens}", flush=True)  # fmt: skip
        prefix = rand(n - qn)
        eng.generate(Request(prefix + rand(qn), 1, reuse=False))
        eng.flush(300)
        if not args.decode_only:
            profiles(eng, prefix, rand, n, qn)
        decode_variants(eng, rand, n, args.decode)
    finally:
        eng.close(30)
        for node in nodes:
            node.stop()


def profiles(eng: Engine, prefix: list[int], rand, n: int, qn: int) -> None:
    top_ops(lambda: eng.generate(Request(prefix + rand(qn), 1, save=False)), "host hit")
    top_ops(lambda: eng.generate(Request(rand(n), 1, reuse=False, save=False)), "recompute")
    top_ops(lambda: eng.generate(Request(rand(256), 8, reuse=False, save=False)), "decode 8")


def decode_variants(eng: Engine, rand, n: int, decode: int) -> None:
    """Decode tok/s after a fresh prefill: no save, a save written back, a save kept in the
    host tier only, and a save whose write-back waits for the copy's event in a thread."""
    conn = eng.connector
    real_submit, real_copied = conn.writeback.submit, conn.writeback._copied

    def no_store(pages, event):
        conn.writeback._drop([(pages, event)])

    async def in_thread(event):
        if event is not None and not event.query():
            await asyncio.to_thread(event.synchronize)

    variants = [("saves off", False, None, None), ("saves on", True, None, None),
                ("saves on, no store write-back", True, no_store, None),
                ("saves on, copy awaited in a thread", True, None, in_thread)]  # fmt: skip
    eng.generate(Request(rand(n), decode, reuse=False, save=True))
    eng.flush(300)
    results: dict[str, list[float]] = {v[0]: [] for v in variants}
    for _ in range(3):
        for name, save, submit, copied in variants:
            conn.writeback.submit = submit or real_submit
            conn.writeback._copied = copied or real_copied
            try:
                r = eng.generate(Request(rand(n), decode, reuse=False, save=save))
                t = time.perf_counter()
                eng.flush(300)
                flush_s = time.perf_counter() - t
            finally:
                conn.writeback.submit, conn.writeback._copied = real_submit, real_copied
            results[name].append(r.decode_tokens_per_s)
            print(f"  {name}: decode {r.decode_s * 1e3:.0f} ms, then flush {flush_s * 1e3:.0f} ms",
                  flush=True)  # fmt: skip
    base = statistics.median(results["saves off"])
    for name, tps in results.items():
        med = statistics.median(tps)
        print(f"decode {name}: {med:.1f} tok/s ({1 - med / base:+.1%} slower) "
              f"runs {[round(x, 1) for x in tps]}")  # fmt: skip


def gil_check() -> None:
    """Does a thread blocked in Event.synchronize() let another thread run Python?"""
    ev = torch.cuda.Event()
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU time on the current stream
    ev.record()
    done = threading.Event()
    th = threading.Thread(target=lambda: (ev.synchronize(), done.set()))
    th.start()
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < 0.3:
        n += 1
    th.join()
    print(
        f"GIL check: {n} loop turns in 0.3 s beside Event.synchronize() "
        f"({'released' if n > 100_000 else 'HELD'}; synchronize returned {done.is_set()})"
    )


if __name__ == "__main__":
    main()

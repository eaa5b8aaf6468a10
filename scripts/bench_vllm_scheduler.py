"""What the vLLM connector's scheduler hooks cost per engine step in a long decode: 256 running
requests with 32k-token contexts (2,048 blocks of 16 tokens each), one token each per step.

Runs in the vLLM venv (``scripts/engines/setup_vllm.sh``) with vLLM's own ``Request`` objects
(its block hasher, sha256) and ``SchedulerOutput`` / ``CachedRequestData`` for every step. A step
times what vLLM's scheduler calls on the connector every step: ``build_connector_meta``,
``update_connector_output`` (nothing to report) and ``get_kv_connector_stats``, i.e.
``SchedulerSide.build_meta`` + ``on_output`` + ``StatsDelta.take``. Request lengths are
staggered so that 1/16 of the requests fill a block each step. The store is never reached
(admission lookups answer "not stored").

Each checkout runs in a child process (its ``pagekv`` first on ``sys.path``): this one, and
with ``--baseline PATH`` another (e.g. f1eb0b9: ``git archive f1eb0b9 | tar -x -C /tmp/base``),
in the same invocation::

    VENV=$(bash scripts/engines/setup_vllm.sh)
    $VENV/bin/python scripts/bench_vllm_scheduler.py --baseline /tmp/base \\
        --out benchmarks/results/bench_vllm_scheduler.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]


def child(path: str, requests: int, context: int, steps: int, save_decode: bool) -> dict:
    sys.path.insert(0, path)
    import torch
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.request import Request

    import pagekv
    from pagekv.connector.vllm.blocks import block_geometry
    from pagekv.connector.vllm.namespace import EngineLayout
    from pagekv.connector.vllm.scheduler import SchedulerSide
    from pagekv.connector.vllm.stats import StatsDelta

    assert pagekv.__file__.startswith(str(Path(path).resolve())), pagekv.__file__
    block = 16
    init_none_hash(sha256)
    hasher = get_request_block_hasher(block, sha256)
    geo = block_geometry(32, 2 * 8 * block * 128 * 2, torch.bfloat16)  # a Llama-3-8B block
    layout = EngineLayout("bench-model", "vllm-v1|bench", (geo,), block, 1, 1, False)
    new_api = "save_decode" in inspect.signature(SchedulerSide).parameters

    class NoStore:  # admission lookups: nothing stored (the steps never reach it)
        def found(self, keys):
            return [False] * min(map(len, keys))

        def lookup_pages(self, keys, timeout_s=None):
            return 0

        def stats(self):
            return {}

    ids: dict[str, list[int]] = {}
    if new_api:
        sched = SchedulerSide(layout, NoStore(), save=True, load_async=True,
                              save_decode=save_decode, epoch="bench",
                              block_ids_of=lambda rid, a, b: ids[rid][a:b])  # fmt: skip
    else:  # f1eb0b9: vLLM's get_block_ids builds the whole list on each call
        sched = SchedulerSide(layout, NoStore(), save=True, load_async=False,
                              block_ids_of=lambda rid: list(ids[rid]))  # fmt: skip
    stats = StatsDelta()
    pool = list(range(1000, 2000))  # shared int objects: 8 bytes a token, not 36
    reqs = []
    start = time.perf_counter()
    for i in range(requests):
        n = context + i % block  # staggered: 1/16 of them fill a block each step
        tokens = [pool[(i * 7919 + j) % len(pool)] for j in range(n)]
        req = Request(f"r{i}", tokens, SamplingParams(max_tokens=1 << 20), None,
                      block_hasher=hasher)  # fmt: skip
        reqs.append(req)
        ids[req.request_id] = list(range(i * 4096, i * 4096 + n // block + 1))
        sched.num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, ids[req.request_id], 0)
    setup_s = time.perf_counter() - start

    def output(scheduled: list, tokens: int, new: list | None = None) -> SchedulerOutput:
        cached = CachedRequestData(
            req_ids=[r.request_id for r in scheduled], resumed_req_ids=set(), new_token_ids=[],
            all_token_ids={}, new_block_ids=[None] * len(scheduled),
            num_computed_tokens=[r.num_computed_tokens for r in scheduled],
            num_output_tokens=[r.num_output_tokens for r in scheduled],
        )  # fmt: skip
        return SchedulerOutput(
            scheduled_new_reqs=new or [], scheduled_cached_reqs=cached,
            num_scheduled_tokens={r.request_id: tokens for r in scheduled},
            total_num_scheduled_tokens=tokens * len(scheduled), scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
            preempted_req_ids=set(),
        )  # fmt: skip

    # prefill, as one step per request (its saves planned): not timed
    for req in reqs:
        so = output([], 0)
        so.num_scheduled_tokens = {req.request_id: req.num_tokens}
        so.scheduled_new_reqs = [SimpleNamespace(req_id=req.request_id, num_computed_tokens=0)]
        sched.build_meta(so)
        req.num_computed_tokens = req.num_tokens
    times, saved = [], 0
    for s in range(steps):
        for req in reqs:  # the token sampled last step (vLLM appends it before scheduling)
            req.append_output_token_ids(pool[s % len(pool)])
            req.num_computed_tokens = req.num_tokens - 1
            if (req.num_tokens - 1) // block >= len(ids[req.request_id]):
                ids[req.request_id].append(ids[req.request_id][-1] + 1)
        so = output(reqs, 1)
        t0 = time.perf_counter_ns()
        meta = sched.build_meta(so)  # build_connector_meta
        sched.on_output(set(), set())  # update_connector_output
        stats.take(sched.counters)  # get_kv_connector_stats
        times.append(time.perf_counter_ns() - t0)
        saved += sum(len(t.block_ids) for t in meta.saves)
    warm = times[len(times) // 10 :]
    us = sorted(t / 1e3 for t in warm)
    return dict(
        pagekv=path, api="new" if new_api else "f1eb0b9", save_decode=save_decode if new_api
        else True, requests=requests, context_tokens=context, block_size=block,
        steps_timed=len(warm), median_us=round(statistics.median(us), 1),
        p90_us=round(us[int(0.9 * len(us))], 1), mean_us=round(statistics.fmean(us), 1),
        decode_blocks_saved=saved, setup_s=round(setup_s, 1),
    )  # fmt: skip


def commit_of(path: str) -> str:
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()  # fmt: skip
    except (subprocess.CalledProcessError, OSError):
        return "unknown"


def run_child(path: str, args: argparse.Namespace, save_decode: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", path, "--requests", str(args.requests),
           "--context", str(args.context), "--steps", str(args.steps)]  # fmt: skip
    if save_decode:
        cmd.append("--save-decode")
    env = dict(os.environ, PYTHONPATH="")  # each child imports its own checkout first
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="another checkout to time in the same run")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", help="write the results (JSON) here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--save-decode", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.requests, args.context, args.steps,
                               args.save_decode)))  # fmt: skip
        return
    runs = []
    if args.baseline:
        runs.append(dict(run_child(args.baseline, args, False), label="baseline"))
    runs.append(dict(run_child(str(REPO), args, False), label="this checkout (defaults)"))
    runs.append(dict(run_child(str(REPO), args, True), label="this checkout, save_decode"))
    result = dict(
        bench="vllm_scheduler_hooks", date=time.strftime("%Y-%m-%d"), commit=commit_of(str(REPO)),
        machine=f"{platform.node()}: {os.cpu_count()} cores, {platform.processor() or '?'}",
        python=platform.python_version(), runs=runs,
    )  # fmt: skip
    for r in runs:
        print(f"{r['label']:30} median {r['median_us']:9.1f} us/step  p90 {r['p90_us']:9.1f}"
              f"  decode blocks saved {r['decode_blocks_saved']}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""One real vLLM engine (``LLM``), driven by the tests over stdin/stdout: one JSON command per
line in, one ``@@``-prefixed JSON answer per line out (vLLM's own output goes to stderr).

argv[1]: {"model": path, "store": [endpoints] | null (no connector), "extra": {...},
          "tp": 1 | 2, "model_id": str | null, "role": "kv_both" | "kv_producer" | "kv_consumer",
          "kv_events": endpoint | absent (vLLM's KV events on, published there)}
Commands: generate, reset_prefix_cache, flush, stats, arm_kill, stall, exit.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from typing import Any

_ANSWERS = sys.stdout


def answer(obj: dict) -> None:
    _ANSWERS.write("@@" + json.dumps(obj) + "\n")
    _ANSWERS.flush()


def route_output() -> None:
    """Answers keep the real stdout; everything else printed (vLLM's logs, progress bars) goes
    to stderr, the test's log file. SIGUSR1 dumps every thread's stack there (for hangs)."""
    global _ANSWERS
    _ANSWERS = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def make_llm(spec: dict) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = dict(
        model=spec["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        max_model_len=2048, disable_log_stats=False, seed=0, gpu_memory_utilization=0.5,
    )  # fmt: skip
    if spec["tp"] > 1:
        kw.update(tensor_parallel_size=spec["tp"], distributed_executor_backend="mp")
    else:
        kw["distributed_executor_backend"] = "uni"
    if spec["store"] is not None:
        extra = dict(store=spec["store"], host_bytes="64MiB", **spec["extra"])
        if spec.get("model_id"):
            extra["model_id"] = spec["model_id"]
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PagekvConnector", kv_connector_module_path="pagekv.connector.vllm",
            kv_role=spec.get("role", "kv_both"), kv_connector_extra_config=extra,
        )  # fmt: skip
    if spec.get("kv_events"):  # vLLM's KV events published on this endpoint (ZeroMQ PUB)
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                endpoint=spec["kv_events"])  # fmt: skip
    return LLM(**kw)


def counters(llm: Any) -> dict[str, float]:
    names = ("vllm:external_prefix_cache_hits", "vllm:external_prefix_cache_queries",
             "vllm:prefix_cache_hits", "vllm:prefix_cache_queries")  # fmt: skip
    out = dict.fromkeys(names, 0.0)
    for metric in llm.get_metrics():
        if metric.name in out and hasattr(metric, "value"):
            out[metric.name] += metric.value
    return out


def scheduler_connector(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def _pagekv_worker() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker


def flush_worker(_worker: Any) -> bool:
    """Runs in every worker process (collective_rpc): write back what is queued."""
    _pagekv_worker().conn.flush_sync(timeout=60)
    return True


def worker_stats(_worker: Any) -> dict:
    """Runs in every worker process (collective_rpc): that rank's pagekv counters."""
    side = _pagekv_worker()
    conn = {k: v for k, v in side.conn.stats().items() if k != "store"}
    return dict(side.counters, connector=conn)


def generate(llm: Any, cmd: dict) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], logprobs=20,
                            ignore_eos=True)  # fmt: skip
    before = counters(llm)
    start = time.monotonic()
    results = llm.generate([{"prompt_token_ids": p} for p in cmd["prompts"]], params,
                           use_tqdm=False)  # fmt: skip
    seconds = time.monotonic() - start
    after = counters(llm)
    outputs = []
    for r in results:
        out = r.outputs[0]
        logprobs = [{str(t): lp.logprob for t, lp in pos.items()} for pos in out.logprobs]
        outputs.append(dict(tokens=list(out.token_ids), logprobs=logprobs,
                            num_cached_tokens=r.num_cached_tokens))  # fmt: skip
    delta = {k.removeprefix("vllm:"): after[k] - before[k] for k in after}
    return dict(outputs=outputs, metrics=delta, seconds=seconds)


def arm_kill(llm: Any, pid: int) -> None:
    """SIGKILL ``pid`` (a store node) right after the scheduler has planned the next load:
    its lookup saw the pages, the workers' fetch will not find the node."""
    conn = scheduler_connector(llm)
    original = conn.update_state_after_alloc

    def hooked(request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0 and conn.update_state_after_alloc is hooked:
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.01)
            conn.update_state_after_alloc = original
        original(request, blocks, num_external_tokens)

    conn.update_state_after_alloc = hooked


def stall(llm: Any, cmd: dict) -> dict:
    """Background requests decode; once each has a token, a request whose prefix the store
    holds is added, and the store node ``pid`` is stopped (SIGSTOP) right before this worker
    starts fetching its pages. Steps the engine until that request finishes (bounded by
    ``limit_s``), then resumes the node (SIGCONT) and aborts the background requests.
    Returns when the node was stopped, when the step that reported the stalled load ended
    (synchronous loads: the step that waited for it), every output's (time, request, tokens so
    far) and the hit request's output."""
    from vllm import SamplingParams

    engine, worker, pid = llm.llm_engine, _pagekv_worker(), cmd["pid"]
    stopped: list[float] = []
    original = worker._start_prefetch

    fetch_done: list[tuple[float, str]] = []  # when the stalled fetch ended, the node's state

    def stop_then_fetch(*args: Any, **kwargs: Any) -> Any:
        if stopped:
            return original(*args, **kwargs)
        os.kill(pid, signal.SIGSTOP)
        stopped.append(time.monotonic())
        deadline = stopped[0] + 5.0
        while _state(pid) != "T" and time.monotonic() < deadline:  # the stop has taken effect
            time.sleep(0.001)
        future = original(*args, **kwargs)
        future.add_done_callback(lambda f: fetch_done.append((time.monotonic(), _state(pid))))
        return future

    worker._start_prefetch = stop_then_fetch
    bg = SamplingParams(temperature=0.0, max_tokens=cmd["bg_tokens"], ignore_eos=True)
    hit = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], logprobs=20,
                         ignore_eos=True)  # fmt: skip
    names = [f"bg{i}" for i in range(len(cmd["background"]))]
    for name, prompt in zip(names, cmd["background"]):
        engine.add_request(name, {"prompt_token_ids": prompt}, bg)
    before = counters(llm)
    timeline: list[tuple[float, str, int]] = []
    tokens: dict[str, int] = {}
    result, added, fetch_ended = None, False, None
    deadline = time.monotonic() + cmd["limit_s"]
    try:
        while result is None and time.monotonic() < deadline:
            for out in engine.step():
                now = time.monotonic()
                tokens[out.request_id] = len(out.outputs[0].token_ids)
                timeline.append((now, out.request_id, tokens[out.request_id]))
                if out.request_id == "hit" and out.finished:
                    result = out
            if stopped and fetch_ended is None and not worker.pending_async:
                fetch_ended = time.monotonic()  # the step that reported the load has ended
            if not added and all(tokens.get(n) for n in names):  # every one is decoding
                engine.add_request("hit", {"prompt_token_ids": cmd["prompt"]}, hit)
                added = True
    finally:
        worker._start_prefetch = original
        if stopped:
            os.kill(pid, signal.SIGCONT)
        engine.abort_request(names)
        while engine.has_unfinished_requests() and time.monotonic() < deadline + 30:
            engine.step()
    if result is None:
        raise RuntimeError(f"the hit request did not finish within {cmd['limit_s']} s")
    after = counters(llm)
    out = result.outputs[0]
    logprobs = [{str(t): lp.logprob for t, lp in pos.items()} for pos in out.logprobs]
    return dict(
        stopped_at=stopped[0] if stopped else None, fetch_ended=fetch_ended, timeline=timeline,
        fetch_done=fetch_done[0] if fetch_done else None,
        output=dict(tokens=list(out.token_ids), logprobs=logprobs),
        metrics={k.removeprefix("vllm:"): after[k] - before[k] for k in after},
    )  # fmt: skip


def _state(pid: int) -> str:
    """The process state letter of ``pid`` (T: stopped), "" if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0]
    except (FileNotFoundError, IndexError):
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] not in "ZX"
    except (FileNotFoundError, IndexError):
        return False


def stats(llm: Any) -> dict:
    sched = scheduler_connector(llm).scheduler
    return dict(scheduler=sched.stats(), workers=llm.collective_rpc(worker_stats))


def main() -> None:
    route_output()
    spec = json.loads(sys.argv[1])
    start = time.monotonic()
    llm = make_llm(spec)
    answer(dict(ready=True, init_seconds=time.monotonic() - start))
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "generate":
                answer(generate(llm, cmd))
            elif cmd["cmd"] == "reset_prefix_cache":
                answer(dict(ok=llm.reset_prefix_cache(reset_connector=cmd.get("connector", False))))
            elif cmd["cmd"] == "flush":
                answer(dict(ok=all(llm.collective_rpc(flush_worker))))
            elif cmd["cmd"] == "stats":
                answer(stats(llm))
            elif cmd["cmd"] == "stall":
                answer(stall(llm, cmd))
            elif cmd["cmd"] == "arm_kill":
                arm_kill(llm, cmd["pid"])
                answer(dict(ok=True))
            elif cmd["cmd"] == "exit":
                answer(dict(ok=True))
                break
            else:
                answer(dict(error=f"unknown command {cmd['cmd']}"))
        except Exception as e:
            traceback.print_exc()
            answer(dict(error=repr(e)))
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()

"""One full learning cycle on the embedded tiny model: serve -> next state -> judge -> train step ->
weight swap -> serve with the new weights. Prints each phase and the total (goal: under 60 s on
2 CPU cores). A real gateway and learner run in-process; the client talks HTTP to them.

    python benchmarks/bench_cycle.py [--cycles 3] [key=value ...]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid


async def cycle(client, model: str, status, k: int) -> dict:
    """One cycle; returns seconds per phase."""
    t0 = time.perf_counter()
    version = (await status())["weight_version"]
    session = {"X-Session-Id": uuid.uuid4().hex}
    asked = [{"role": "user", "content": f"What is {k} + {k + 3}?"}]
    r = await client.post("/v1/chat/completions", headers=session,
                          json={"model": model, "messages": asked, "max_tokens": 24})
    reply = r.json()["choices"][0]["message"]["content"]
    t_served = time.perf_counter()
    await client.post("/v1/chat/completions", headers={**session, "X-Session-Done": "1"}, json={
        "model": model, "max_tokens": 1,
        "messages": asked + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Thanks!"}]})
    t_next = time.perf_counter()
    judged_at = None
    while True:
        s = await status()
        t = s["training"]
        if judged_at is None and t["samples"]["judged"] > k:
            judged_at = time.perf_counter()
        if s["weight_version"] > version and t["train_step"] > k:
            break
        await asyncio.sleep(0.02)
    t_swapped = time.perf_counter()
    r = await client.post("/v1/chat/completions", json={"model": model, "max_tokens": 8,
                                                         "messages": [{"role": "user", "content": "Hi"}]})
    assert r.json()["system_fingerprint"] == f"clawrl-w{version + 1}", "not served by the new weights"
    t_end = time.perf_counter()
    return {"serve": t_served - t0, "next_state": t_next - t_served, "judge": (judged_at or t_swapped) - t_next,
            "train_and_swap": t_swapped - (judged_at or t_next), "serve_new": t_end - t_swapped, "total": t_end - t0}


async def main(args) -> None:
    import httpx
    import uvicorn

    from clawrl.config import compose
    from clawrl.embedded.build import resolve_model
    from clawrl.engines import make_engine
    from clawrl.gateway.app import create_app
    from clawrl.orchestration.learner import attach_learning
    from clawrl.orchestration.serve import bind_socket
    from clawrl.sessions import SessionLinker
    from clawrl.store import TurnStore

    run_dir = tempfile.mkdtemp(prefix="bench-cycle-")
    cfg = resolve_model(compose([f"run_dir={run_dir}", "train.batch_size=1", "train.save_every=1000",
                                 "logging.wandb.mode=disabled", "logging.level=WARNING", *args.overrides]))
    t_load = time.perf_counter()
    engine = make_engine(cfg)
    store = TurnStore(cfg.run_dir)
    app = create_app(cfg, engine, SessionLinker(store, idle_timeout_s=cfg.sessions.idle_timeout_s))
    attach_learning(app, cfg, engine, store)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.05)
    print(f"model {engine.model_info().name}: loaded and learner started in {time.perf_counter() - t_load:.1f} s")
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        async def status():
            return (await client.get("/admin/status")).json()

        results = []
        for k in range(args.cycles):
            r = await cycle(client, engine.model_info().name, status, k)
            results.append(r)
            print(f"cycle {k + 1}: " + ", ".join(f"{name} {v:.2f} s" for name, v in r.items()), flush=True)
    server.should_exit = True
    await serving
    totals = [r["total"] for r in results]
    print(f"full cycle (serve -> judge -> train step -> swap -> serve new weights): median {statistics.median(totals):.2f} s, "
          f"max {max(totals):.2f} s over {len(totals)} cycles (goal: under 60 s)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. model.path=DIR")
    asyncio.run(main(p.parse_args()))

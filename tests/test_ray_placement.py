"""Engines placed with Ray (cluster.ray=true) on a two-node local cluster (ray.cluster_utils.Cluster).

One cluster and one pair of engine actors serve the whole module: Ray and two actor processes take
most of this file's time on a 2-core box. Each node offers 2 CPUs, so both engines would fit on one
node: landing on two nodes is the SPREAD placement at work, not a lack of room.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import torch

from clawrl.config import ClawrlConfig, ClusterConfig, EngineConfig, ModelConfig
from clawrl.engines.base import EngineError, SamplingParams
from clawrl.engines.loading import ModelLoadError, load_model
from clawrl.engines.torch_engine import TorchEngine
from engine_testing import make_model_dir

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 8], [44, 45, 46, 47, 48, 49, 50], [250, 1, 250, 3]]


def run(coro):
    return asyncio.run(coro)


def free_cpus_settle_at(n: float, timeout_s: float = 10.0) -> bool:
    """Ray frees a removed group's resources asynchronously; wait for the count to come back."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) != n and time.monotonic() < deadline:
        time.sleep(0.1)
    return ray.available_resources().get("CPU", 0) == n


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": 80 * 2**20})
    try:
        c.add_node(num_cpus=2, object_store_memory=80 * 2**20)
        c.wait_for_nodes()
        # Actors inherit the job's env: one thread each, so two engines don't fight over 2 cores.
        ray.init(address=c.address, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("ray_model") / "m", "qwen3", seed=0)


def ray_cfg(model_dir, address: str, **cluster) -> ClawrlConfig:
    return replace(ClawrlConfig(), model=ModelConfig(path=str(model_dir), device="cpu"),
                   cluster=ClusterConfig(ray=True, ray_address=address, **{"timeout_s": 60.0, **cluster}))


@pytest.fixture(scope="module")
def engines(cluster, model_dir):
    """(RayEngine over two actors, a local TorchEngine on the same directory)."""
    from clawrl.engines.ray_engine import make_ray_engine

    remote = make_ray_engine(ray_cfg(model_dir, cluster.address, engines=2))
    local = TorchEngine(load_model(str(model_dir), device="cpu"), EngineConfig())
    try:
        run(remote.start())
        yield remote, local
    finally:
        run(remote.shutdown())
        run(local.shutdown())


def test_engines_land_on_two_nodes_and_greedy_matches_local(engines):
    remote, local = engines
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    nodes = [p.node_id for p in remote.placements]
    assert len(alive) == 2 and set(nodes) == alive, (nodes, alive)
    assert [n["node_id"] for n in remote.model_info().extra["nodes"]] == nodes

    async def check():
        expected = [await local.generate(p, GREEDY) for p in PROMPTS]
        routed = await asyncio.gather(*(remote.generate(p, GREEDY) for p in PROMPTS))
        assert [r.token_ids for r in routed] == [e.token_ids for e in expected]
        for actor in remote.actors:  # each engine on its own, not just whichever the router chose
            direct = [await actor.generate.remote(p, GREEDY) for p in PROMPTS]
            assert [r.token_ids for r in direct] == [e.token_ids for e in expected]
        assert remote.model_info().name == local.model_info().name
        assert remote.tokenizer.decode(routed[0].token_ids) == local.tokenizer.decode(expected[0].token_ids)

    run(check())


def test_concurrent_streams_go_to_different_engines_and_closing_aborts(engines):
    remote, _ = engines
    long = SamplingParams(max_new_tokens=3000, temperature=0.0, ignore_eos=True)

    async def check():
        streams = [remote.stream(PROMPTS[0], long), remote.stream(PROMPTS[1], long)]
        for s in streams:
            await s.__anext__()  # both are decoding now
        health = await remote.health()
        assert [e["running"] for e in health["engines"]] == [1, 1], health
        for s in streams:
            await s.aclose()
        deadline = time.monotonic() + 20
        while (await remote.health())["running"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert (await remote.health())["running"] == 0

    run(check())


def test_stream_sends_several_chunks_ending_with_the_reason_and_local_logprobs(engines):
    remote, local = engines
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, top_logprobs=2)

    async def check():
        expected = await local.generate(PROMPTS[2], params)
        chunks = [c async for c in remote.stream(PROMPTS[2], params)]
        assert len(chunks) >= 2
        assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert chunks[-1].finish_reason == "length"
        ids = [t for c in chunks for t in c.token_ids]
        lps = [lp for c in chunks for lp in c.logprobs]
        assert ids == expected.token_ids
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(expected.logprobs), atol=1e-5, rtol=0)
        tops = [row for c in chunks for row in c.top_logprobs]
        assert [[i for i, _ in row] for row in tops] == [[i for i, _ in row] for row in expected.top_logprobs]
        # A seeded sampled request draws the same tokens in the actor as here.
        seeded = SamplingParams(max_new_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
        drawn = await remote.generate(PROMPTS[0], seeded)
        assert drawn.token_ids == (await local.generate(PROMPTS[0], seeded)).token_ids
        # Bad prompts are refused when the stream opens, as a local engine refuses them.
        with pytest.raises(EngineError, match="outside the vocabulary"):
            remote.stream([10**6], GREEDY)

    run(check())


def test_update_weights_reaches_every_engine_with_one_version(engines):
    remote, local = engines
    gen = torch.Generator().manual_seed(0)
    state = {name: p.detach() + 0.2 * torch.randn(p.shape, generator=gen)
             for name, p in local.model.named_parameters()}
    version = remote.model_info().weight_version + 5

    async def check():
        before = await local.generate(PROMPTS[0], GREEDY)
        await asyncio.gather(remote.update_weights(state, version), local.update_weights(state, version))
        after = await local.generate(PROMPTS[0], GREEDY)
        assert after.token_ids != before.token_ids  # the perturbation changes greedy output
        for actor in remote.actors:
            out = await actor.generate.remote(PROMPTS[0], GREEDY)
            assert out.token_ids == after.token_ids
            assert out.weight_versions == [version] * len(out.token_ids)
            torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(after.logprobs), atol=1e-5, rtol=0)
        assert remote.model_info().weight_version == version
        assert remote.model_info().extra["weight_versions"] == [version, version]
        health = await remote.health()
        assert health["ok"] and health["weight_version"] == version
        assert [e["weight_version"] for e in health["engines"]] == [version, version]

    run(check())


def test_more_engines_than_the_cluster_holds_fail_fast_naming_the_resource(engines, cluster, model_dir):
    from clawrl.engines.ray_engine import make_ray_engine

    for extra, missing in [(dict(engines=5), "CPU 5 needed, 2 free of 4"),
                           (dict(engines=1, engine_gpus=1.0), "GPU 1 needed, 0 free of 0")]:
        start = time.monotonic()
        with pytest.raises(EngineError) as err:
            make_ray_engine(ray_cfg(model_dir, cluster.address, timeout_s=2.0, **extra))
        assert time.monotonic() - start < 20
        msg = str(err.value)
        assert "\n" not in msg and "Ray could not place" in msg and missing in msg, msg
    # Nothing stays reserved: the failed groups were removed, only the module's two engines hold CPUs.
    assert free_cpus_settle_at(2)


def test_bad_addresses_and_paths_are_refused_in_one_line(cluster, model_dir, tmp_path):
    from clawrl.engines.ray_engine import make_ray_engine

    with pytest.raises(EngineError, match=r"^cannot reach the Ray cluster at 127\.0\.0\.1:1 .*refused"):
        make_ray_engine(ray_cfg(model_dir, "127.0.0.1:1", timeout_s=5.0))
    with pytest.raises(EngineError, match="is not auto, local, host:port"):
        make_ray_engine(ray_cfg(model_dir, "nowhere", timeout_s=5.0))
    with pytest.raises(ModelLoadError, match="is not a directory on this machine"):
        make_ray_engine(ray_cfg(tmp_path / "missing", cluster.address))
    with pytest.raises(EngineError, match="cluster.engines must be at least 1"):
        make_ray_engine(ray_cfg(model_dir, cluster.address, engines=0))


def test_a_model_that_fails_to_load_on_its_node_is_reported_in_one_line(engines, cluster, model_dir, tmp_path):
    import shutil

    from clawrl.engines.ray_engine import make_ray_engine

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # the tokenizer loads on the driver; the actor fails
    with pytest.raises(ModelLoadError, match="corrupt weights file .*truncated") as err:
        make_ray_engine(ray_cfg(broken, cluster.address, engines=1))
    assert "\n" not in str(err.value)
    assert free_cpus_settle_at(2)

"""Weight updates into SGLang from a distributed group, on the CPU with gloo.

Three parties, as in a run with ``engine.backend=sglang`` and the megatron trainer:
- the driver: ``SGLangWeightSync`` and the engine's ``SGLangWeightUpdates``, speaking to SGLang over
  HTTP (``HttpControl``);
- SGLang: tests/fake_sglang_server.py in its own process, which accepts only requests that SGLang
  0.5.23's source defines (routes, request classes, fields) and joins and receives over the group
  with SGLang's own functions compiled from its installed source;
- trainer rank 0: ``SGLangGroupSender`` (what ``MegatronRanks.send_weights`` opens for this endpoint)
  in a thread of this process.
The tensors SGLang received are compared bit for bit with those sent, and the requests with the
order of operations (pause, session, buckets, flush, continue).
"""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from clawrl.config import ClusterConfig
from clawrl.engines.base import EngineError
from clawrl.engines.sglang_engine import HttpControl, SGLangWeightUpdates
from clawrl.weight_sync import SGLangWeightSync
from clawrl.weight_transport import ServedWeights, WeightSyncError
from tests import sglang_source
from tests.required_tools import skip_unless_available

SERVER = Path(__file__).with_name("fake_sglang_server.py")


@pytest.fixture(scope="module")
def sglang_url():
    skip_unless_available("sglang", "sglang is not installed (pip install --no-deps -r requirements-sglang.txt)",
                          available=sglang_source.SPEC is not None)
    proc = subprocess.Popen([sys.executable, str(SERVER)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def _get(url: str, path: str):
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return json.loads(r.read())


def _post(url: str, path: str, body) -> int:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Trainer:
    """``StreamsWeights`` as trainer rank 0 does it: one sender per endpoint, kept between pushes."""

    def __init__(self, state: dict[str, torch.Tensor], fail_after: int | None = None):
        self.state, self.fail_after, self.sender, self.buckets = state, fail_after, None, []

    def tensors(self):
        for i, item in enumerate(self.state.items()):
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError("gather failed on rank 3")
            yield item

    def send_weights(self, version, endpoint):
        if self.sender is None or self.sender.endpoint != endpoint:
            if self.sender is not None:
                self.sender.close()
            self.sender = endpoint.open_sender()
        self.buckets = self.sender.send(version, self.tensors())


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # bucket_mb=1: the float32 tensors fill two buckets, the bfloat16 ones go in buckets of their own dtype
    return {"embed.weight": torch.randn(300, 512, generator=g),  # 600 KiB
            "layer.0.weight": torch.randn(200, 512, generator=g),  # 400 KiB: with embed, 1000 KiB
            "layer.1.weight": torch.randn(100, 512, generator=g),  # next bucket
            "layer.1.bias": torch.randn(512, generator=g),
            "norm.weight": torch.randn(512, generator=g).to(torch.bfloat16),  # a dtype change: a new bucket
            "lm_head.weight": torch.randn(700, 1024, generator=g).to(torch.bfloat16)}  # 1.4 MiB: alone


def _served(state) -> ServedWeights:
    return ServedWeights({k: tuple(v.shape) for k, v in state.items()}, frozenset(state))


def _sync(url, state, **kw) -> tuple[SGLangWeightSync, SGLangWeightUpdates]:
    updates = SGLangWeightUpdates(HttpControl(url, timeout_s=60), group_ranks=1)
    cluster = ClusterConfig(timeout_s=60.0, bucket_mb=1)
    sync = SGLangWeightSync(updates, _served(state), cluster, host="127.0.0.1", port=0, group_host="127.0.0.1",
                            group_port=_free_port(), backend="gloo", **kw)
    return sync, updates


def _routes_since(url: str, start: int) -> list[tuple[str, dict | None]]:
    log = _get(url, "/_log")[start:]
    assert not [e for e in log if e["refused"]], f"SGLang's source refuses: {[e for e in log if e['refused']]}"
    return [(e["route"], e["body"]) for e in log]


def _served_weights(url):
    got = _get(url, "/_weights")
    return got, {k: torch.tensor(v[2], dtype=torch.float64).reshape(v[1]) for k, v in got["weights"].items()}


def _assert_received(url, state, version):
    got, weights = _served_weights(url)
    assert got["version"] == str(version) and got["paused"] is False
    for name, tensor in state.items():
        assert got["weights"][name][0] == str(tensor.dtype), name
        assert torch.equal(weights[name], tensor.double()), f"{name} differs after the broadcast"


def test_fake_server_refuses_what_sglang_would(sglang_url):
    """The stand-in is strict, so the requests it accepts below are SGLang's."""
    assert _post(sglang_url, "/pause_generation", {"mode": "retract"}) == 200
    assert _post(sglang_url, "/pause_generation", {"mode": "keep"}) == 422  # not one of SGLang's modes
    assert _post(sglang_url, "/init_weights_update_group", {"master_address": "x", "master_port": 1}) == 422
    assert _post(sglang_url, "/update_weights_from_distributed",
                 {"names": [], "dtypes": [], "shapes": [], "flush": True}) == 422  # misspelt field
    assert _post(sglang_url, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}) == 400
    assert _post(sglang_url, "/continue_generation", {}) == 200


def test_push_over_sglangs_group_in_order_and_bit_exact(sglang_url):
    state = _state(0)
    sync, updates = _sync(sglang_url, state)
    trainer = Trainer(state)
    start = len(_get(sglang_url, "/_log"))

    ms = asyncio.run(sync.push(trainer, 1))
    assert ms > 0 and sync.version == updates.version == 1 and not updates.paused
    _assert_received(sglang_url, state, 1)
    routes = _routes_since(sglang_url, start)
    names = [r for r, _ in routes]
    n = len(trainer.buckets)
    assert [b.names for b in trainer.buckets] == [("embed.weight", "layer.0.weight"), ("layer.1.weight", "layer.1.bias"),
                                                  ("norm.weight",), ("lm_head.weight",)]
    assert names == (["/init_weights_update_group", "/pause_generation", "/begin_weight_update"]
                     + ["/update_weights_from_distributed"] * n
                     + ["/end_weight_update", "/flush_cache", "/continue_generation"])
    init = routes[0][1]
    assert (init["rank_offset"], init["world_size"], init["backend"]) == (1, 2, "gloo")
    assert routes[1][1] == {"mode": "retract"}  # running requests wait in SGLang's queue, none fails
    for (_, body), bucket in zip(routes[3:3 + n], trainer.buckets):
        assert body["names"] == list(bucket.names) and body["load_format"] == "flattened_bucket"
        assert body["group_name"] == init["group_name"] and body["weight_version"] == "1"
        assert body["flush_cache"] is False  # flushed once, after the last bucket
        assert body["shapes"] == [list(state[k].shape) for k in bucket.names]

    # the next version reuses the group (no second init) and replaces every tensor
    state2 = {k: v + 1 for k, v in state.items()}
    trainer.state = state2
    start = len(_get(sglang_url, "/_log"))
    asyncio.run(sync.push(trainer, 2))
    assert [r for r, _ in _routes_since(sglang_url, start)][:2] == ["/pause_generation", "/begin_weight_update"]
    _assert_received(sglang_url, state2, 2)
    with pytest.raises(WeightSyncError, match="not above the served version 2"):
        asyncio.run(sync.push(trainer, 2))


def test_a_header_the_engine_does_not_serve_is_refused_before_sglang_loads_anything(sglang_url):
    state = _state(1)
    sync, updates = _sync(sglang_url, {**state, "extra.weight": torch.zeros(3)})
    bad = dict(state)
    bad["norm.weight"] = torch.zeros(7, 7, dtype=torch.bfloat16)  # a wrong shape in the third bucket
    start = len(_get(sglang_url, "/_log"))
    with pytest.raises(WeightSyncError, match=r"^weight version 1 was not served by SGLang: 'norm.weight' has shape "
                                              r"\(7, 7\); the engine serves \(512,\)"):
        asyncio.run(sync.push(Trainer(bad), 1))
    names = [r for r, _ in _routes_since(sglang_url, start)]
    # two buckets landed, then a header was refused: SGLang now holds a mix, so it stays paused
    assert names.count("/update_weights_from_distributed") == 2 and "/continue_generation" not in names
    assert updates.paused and "generation stays paused" in updates.paused_reason
    assert "/destroy_weights_update_group" in names and "/end_weight_update" in names
    # the next push forms a new group (new generation) and resumes
    start = len(_get(sglang_url, "/_log"))
    asyncio.run(sync.push(Trainer({**state, "extra.weight": torch.ones(3)}), 2))
    routes = _routes_since(sglang_url, start)
    assert routes[0][0] == "/init_weights_update_group" and routes[0][1]["group_name"].endswith("_1")
    assert routes[-1][0] == "/continue_generation" and not updates.paused and updates.paused_reason is None
    _assert_received(sglang_url, {**state, "extra.weight": torch.ones(3)}, 2)


def test_a_trainer_failing_before_any_bucket_resumes_the_old_weights(sglang_url):
    state = _state(2)
    sync, updates = _sync(sglang_url, state)
    trainer = Trainer(state)
    asyncio.run(sync.push(trainer, 1))
    before = _served_weights(sglang_url)[1]
    start = len(_get(sglang_url, "/_log"))
    trainer.state, trainer.fail_after = {k: v * 2 for k, v in state.items()}, 0
    with pytest.raises(WeightSyncError, match="the sender aborted: RuntimeError: gather failed on rank 3"):
        asyncio.run(sync.push(trainer, 2))
    names = [r for r, _ in _routes_since(sglang_url, start)]
    assert names == ["/pause_generation", "/begin_weight_update", "/end_weight_update", "/continue_generation",
                     "/destroy_weights_update_group"]  # nothing loaded: the old weights serve on
    assert not updates.paused and updates.version == sync.version == 1
    after = _served_weights(sglang_url)[1]
    assert all(torch.equal(before[k], after[k]) for k in state)


def test_sglang_refusing_a_bucket_is_a_one_line_error(sglang_url):
    state = _state(3)
    sync, updates = _sync(sglang_url, state)
    assert _post(sglang_url, "/_refuse", {"route": "/update_weights_from_distributed", "after": 0}) == 200
    with pytest.raises(WeightSyncError, match="SGLang refused update_weights_from_distributed \\(HTTP 400\\)"):
        asyncio.run(sync.push(Trainer(state), 1))
    assert updates.version == 0


def test_weight_updates_session_order_for_tensor_and_disk_loads():
    """The in-process path uses the same order; a control that records what it is sent."""
    class Recorder:
        def __init__(self):
            self.sent = []

        async def send(self, op, kwargs):
            self.sent.append(op)
            if op == "end_weight_update" and "fail" in self.sent:
                raise EngineError("x")

    rec = Recorder()
    updates = SGLangWeightUpdates(rec)
    asyncio.run(updates.from_tensor(b"payload", 3))
    assert rec.sent == ["pause_generation", "begin_weight_update", "update_weights_from_tensor", "end_weight_update",
                        "flush_cache", "continue_generation"]
    rec.sent.clear()
    asyncio.run(updates.from_disk("/ckpt", 4))  # SGLang loads from disk without a session
    assert rec.sent == ["pause_generation", "update_weights_from_disk", "continue_generation"] and updates.version == 4
    rec.sent.clear()
    asyncio.run(updates.pause())  # paused by the operator: an update leaves it paused
    asyncio.run(updates.from_tensor(b"p", 5))
    assert rec.sent[-1] == "flush_cache" and updates.paused and updates.version == 5
    asyncio.run(updates.resume())


def test_a_refused_session_resumes_and_a_refused_load_stays_paused():
    class Refuse:
        def __init__(self, op):
            self.op, self.sent = op, []

        async def send(self, op, kwargs):
            self.sent.append(op)
            if op == self.op:
                raise EngineError(f"SGLang refused {op}: no")

    rec = Refuse("begin_weight_update")  # nothing reached the model: the old weights serve on
    updates = SGLangWeightUpdates(rec)
    with pytest.raises(EngineError, match="refused begin_weight_update"):
        asyncio.run(updates.from_tensor(b"p", 1))
    assert rec.sent == ["pause_generation", "begin_weight_update", "continue_generation"]
    assert not updates.paused and updates.version == 0
    rec = Refuse("update_weights_from_tensor")  # a load that failed may have applied in part
    updates = SGLangWeightUpdates(rec)
    with pytest.raises(EngineError, match="refused update_weights_from_tensor"):
        asyncio.run(updates.from_tensor(b"p", 1))
    assert rec.sent == ["pause_generation", "begin_weight_update", "update_weights_from_tensor", "end_weight_update"]
    assert updates.paused and "weight version 1 failed after part of it was loaded" in updates.paused_reason
    rec.op = None  # the next update succeeds and resumes
    asyncio.run(updates.from_tensor(b"p", 2))
    assert rec.sent[-1] == "continue_generation" and not updates.paused and updates.paused_reason is None
    rec = Refuse("update_weights_from_tensor")  # after a partial load, a whole checkpoint from disk resumes
    updates = SGLangWeightUpdates(rec)
    with pytest.raises(EngineError):
        asyncio.run(updates.from_tensor(b"p", 1))
    rec.sent.clear()
    asyncio.run(updates.from_disk("/ckpt", 2))
    assert rec.sent == ["update_weights_from_disk", "continue_generation"] and not updates.paused
    rec.op, rec.sent = "update_weights_from_disk", []  # SGLang rolls a failed disk load back: serve on
    with pytest.raises(EngineError):
        asyncio.run(updates.from_disk("/bad", 3))
    assert rec.sent == ["pause_generation", "update_weights_from_disk", "continue_generation"]
    assert not updates.paused and updates.version == 2


def test_the_megatron_trainer_hands_an_sglang_engine_its_group(tmp_path):
    """``trainer.backend=megatron`` with ``engine.backend=sglang``: the driver's transport is
    ``SGLangWeightSync``, whose endpoint rank 0 opens as an ``SGLangGroupSender``; the group's
    rendezvous is ``cluster.sglang_group_port``, or MASTER_PORT + 3."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from clawrl.config import compose
    from clawrl.trainers.base import TrainerError
    from clawrl.trainers.megatron.trainer import MegatronTrainer
    from clawrl.weight_transport_sglang import SGLangGroupEndpoint

    LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2).save_pretrained(tmp_path)

    class Refuses:
        async def send(self, op, kwargs):
            raise AssertionError("nothing is sent to SGLang before a push")

    device = "cuda:0"
    engine = SimpleNamespace(weight_updates=SGLangWeightUpdates(Refuses()),
                             model_info=lambda: SimpleNamespace(path=str(tmp_path), device=device))
    trainer = MegatronTrainer.__new__(MegatronTrainer)
    trainer.cfg = compose(["engine.backend=sglang", "trainer.backend=megatron"])
    trainer.node = SimpleNamespace(master_addr="127.0.0.1", master_port=20000, sync_port=_free_port(), procs=1)
    with pytest.raises(TrainerError, match=r"SGLang serves on GPU 0, which a trainer rank of this node uses; .* "
                                           r"set model.device=cuda:N with N >= 1"):
        trainer.weight_sync(engine)
    device = "cuda:1"
    for override, port in (([], 20003), (["cluster.sglang_group_port=29999"], 29999)):
        trainer = MegatronTrainer.__new__(MegatronTrainer)
        trainer.cfg = compose(["engine.backend=sglang", "trainer.backend=megatron", *override])
        trainer.node = SimpleNamespace(master_addr="127.0.0.1", master_port=20000, sync_port=_free_port(), procs=1)
        sync = trainer.weight_sync(engine)
        try:
            assert isinstance(sync, SGLangWeightSync)
            endpoint = sync.endpoint
            assert isinstance(endpoint, SGLangGroupEndpoint)
            assert (endpoint.master_address, endpoint.master_port, endpoint.world_size) == ("127.0.0.1", port, 2)
            assert endpoint.store_port == trainer.node.sync_port and endpoint.bucket_bytes == 256 << 20
            assert "model.embed_tokens.weight" in sync.served.required
        finally:
            sync.close()

"""Weight sync across processes over gloo, as the megatron backend runs it: a TorchEngine in a
process of its own (the driver) receives HF-named buckets that a trainer process streams, serves
them under the new version, and on any failure keeps serving the old one and syncs again after."""
from __future__ import annotations

import asyncio
import os
import queue
import re
import threading
import time
import weakref

import pytest
import torch
import torch.multiprocessing as mp

from clawrl.weight_transport import (BucketReceiver, BucketSender, ServedWeights, SyncEndpoint, WeightSyncError,
                                     host_store)

TIMEOUT_S = 3.0  # cluster.timeout_s in the engine process: a stalled sender fails after this
WAIT_S = 60.0  # the test gives up on a process that says nothing for this long
PROMPTS = ([5, 17, 42, 99, 3, 250, 8], [300, 12, 77])
NEW_TOKENS = 12
# hidden 256 makes a 7 MB model: several 1 MiB buckets, and MLP matrices (256 x 1100 floats, 1.07 MiB)
# that are larger than a bucket and go alone.
MODEL = dict(hidden_size=256, intermediate_size=1100)


# ---- the engine process: a TorchEngine behind BroadcastWeightSync, driven over queues ----

class QueueSource:
    """The driver's handle on the trainer: asks the test to have the trainer stream, waits for its word."""

    def __init__(self, to_trainer, from_trainer):
        self.to_trainer, self.from_trainer = to_trainer, from_trainer

    def send_weights(self, version, endpoint):
        self.to_trainer.put((version, endpoint))
        status, detail = self.from_trainer.get(timeout=WAIT_S)
        if status != "ok":
            raise RuntimeError(f"trainer: {detail}")


def _engine_main(model_dir, commands, replies, to_trainer, from_trainer):
    torch.set_num_threads(1)
    from clawrl.config import compose
    from clawrl.engines.base import SamplingParams
    from clawrl.engines.loading import load_model
    from clawrl.engines.torch_engine import TorchEngine
    from clawrl.weight_sync import BroadcastWeightSync

    cfg = compose(["model.device=cpu", f"cluster.timeout_s={TIMEOUT_S}", "cluster.bucket_mb=1"])
    engine = TorchEngine(load_model(model_dir, device="cpu"), cfg.engine)
    sync = BroadcastWeightSync(engine, cfg.cluster)
    source = QueueSource(to_trainer, from_trainer)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    async def serve():
        await engine.start()
        while (command := await asyncio.to_thread(commands.get)) is not None:
            kind, arg = command
            try:
                if kind == "greedy":
                    results = await asyncio.gather(*(engine.generate(p, greedy) for p in PROMPTS))
                    replies.put(("ok", [r.token_ids for r in results]))
                elif kind == "sync":
                    replies.put(("ok", await sync.push(source, arg)))
                elif kind == "version":
                    replies.put(("ok", (engine.weight_version, sync.version)))
            except WeightSyncError as e:
                replies.put(("WeightSyncError", str(e)))
        await engine.shutdown()
        sync.close()

    asyncio.run(serve())


# ---- the trainer process: rank 0's side, one BucketSender per group generation ----

def _trainer_main(commands, reports, resume):
    torch.set_num_threads(1)
    from safetensors.torch import load_file

    reports.put(("ready", None))
    sender = None
    while (job := commands.get()) is not None:
        path, version, endpoint, stop_after, how = job
        state = load_file(path)

        def tensors():
            for i, item in enumerate(state.items()):
                if i == stop_after:
                    if how == "die":
                        os._exit(17)
                    resume.wait(WAIT_S)  # stall until the test has seen the engine give up
                yield item

        try:
            if sender is None or sender.endpoint != endpoint:
                if sender is not None:
                    sender.close()
                sender = BucketSender(endpoint)
            sent = sender.send(version, tensors())
            reports.put(("ok", [(b.names, b.nbytes) for b in sent]))
        except Exception as e:
            reports.put(("error", f"{type(e).__name__}: {e}"))


def _get(q, proc, who):
    """The next item from ``q``; ("died", exit code) if ``proc`` dies first; fails the test after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            if not proc.is_alive():
                return ("died", proc.exitcode)
    pytest.fail(f"{who} said nothing for {WAIT_S} s")


class Cluster:
    """The test plays the driver's control channel between the engine process and the trainer process."""

    def __init__(self, model_dir):
        self.ctx = mp.get_context("spawn")
        self.engine_queues = [self.ctx.Queue() for _ in range(4)]
        self.commands, self.replies, self.to_trainer, self.from_trainer = self.engine_queues
        self.engine = self.ctx.Process(target=_engine_main, args=(str(model_dir), *self.engine_queues), daemon=True)
        self.engine.start()
        self.trainer = None
        self.start_trainer()

    def start_trainer(self):
        self.jobs, self.reports, self.resume = self.ctx.Queue(), self.ctx.Queue(), self.ctx.Event()
        self.trainer = self.ctx.Process(target=_trainer_main, args=(self.jobs, self.reports, self.resume), daemon=True)
        self.trainer.start()
        # Ready before any sync, so the engine's receiver never waits out its timeout on an import.
        assert _get(self.reports, self.trainer, "the trainer process") == ("ready", None)

    def ask(self, kind, arg=None):
        self.commands.put((kind, arg))
        return self._outcome(_get(self.replies, self.engine, "the engine process"))

    @staticmethod
    def _outcome(reply):
        status, value = reply
        if status == "WeightSyncError":
            raise WeightSyncError(value)
        assert status == "ok", f"engine process: {reply}"
        return value

    def sync(self, version, weights, send_version=None, stop_after=None, how=None):
        """Push ``version`` with the trainer streaming ``weights``; returns the trainer's report
        (("ok", [(names, nbytes) per bucket]) or why not) and the engine's sync ms, or raises its
        WeightSyncError."""
        self.commands.put(("sync", version))
        asked, endpoint = _get(self.to_trainer, self.engine, "the engine's weight source")
        assert asked == version and endpoint.bucket_bytes == 1 << 20 and endpoint.backend == "gloo"
        self.resume.clear()
        self.jobs.put((str(weights), send_version or version, endpoint, stop_after, how))
        if how == "stall":  # the engine gives up while the trainer is stalled, then the trainer finds out
            reply = _get(self.replies, self.engine, "the engine process")
            self.resume.set()
            report = _get(self.reports, self.trainer, "the trainer process")
            self.from_trainer.put(report)
        else:
            report = _get(self.reports, self.trainer, "the trainer process")
            self.from_trainer.put(report)
            reply = _get(self.replies, self.engine, "the engine process")
        self.last_report = report
        if report[0] == "died":
            self.start_trainer()  # a restarted trainer: no group until the driver hands out an endpoint
        return self._outcome(reply)

    def close(self):
        for q, proc in ((self.commands, self.engine), (self.jobs, self.trainer)):
            if proc.is_alive():
                q.put(None)
        for proc in (self.engine, self.trainer):
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine_testing import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("transport_model") / "q3", "qwen3", seed=3, **MODEL)


@pytest.fixture(scope="module")
def cluster(model_dir):
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned processes
    try:
        c = Cluster(model_dir)
    finally:
        os.environ.pop("OMP_NUM_THREADS") if old is None else os.environ.__setitem__("OMP_NUM_THREADS", old)
    yield c
    c.close()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def perturbed(hf_model, seed, path):
    """The base weights plus seeded noise, written where the trainer process reads them."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    state = {n: (p.detach() + 0.1 * torch.randn(p.shape, generator=g)).contiguous()
             for n, p in hf_model.named_parameters()}  # a tied lm_head is the embedding, sent once
    save_file(state, str(path))
    return state


def hf_greedy(hf_model, state):
    """Greedy tokens of the HF model with ``state`` loaded: what the engine must now produce."""
    saved = {k: v.clone() for k, v in hf_model.state_dict().items()}
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    try:
        out = []
        with torch.no_grad():
            for prompt in PROMPTS:
                ids = list(prompt)
                for _ in range(NEW_TOKENS):
                    ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
                out.append(ids[len(prompt):])
        return out
    finally:
        hf_model.load_state_dict(saved)


def next_version(cluster):
    engine_version, sync_version = cluster.ask("version")
    assert engine_version == sync_version
    return engine_version + 1


def test_streamed_buckets_serve_the_trainers_weights(cluster, hf_model, tmp_path):
    before = cluster.ask("greedy")
    version = next_version(cluster)
    state = perturbed(hf_model, seed=1, path=tmp_path / "w.safetensors")

    ms = cluster.sync(version, tmp_path / "w.safetensors")

    expected = hf_greedy(hf_model, state)
    assert expected != before  # the perturbation changes greedy output, so this test can fail
    assert cluster.ask("greedy") == expected
    assert cluster.ask("version") == (version, version) and ms > 0
    status, buckets = cluster.last_report
    assert status == "ok" and len(buckets) >= 5
    assert sorted(n for names, _ in buckets for n in names) == sorted(state)
    for names, nbytes in buckets:  # at most 1 MiB, but for a single larger tensor alone
        assert nbytes <= 1 << 20 or len(names) == 1
    alone = [names[0] for names, nbytes in buckets if nbytes > 1 << 20]
    assert sorted(alone) == sorted(n for n, t in state.items() if t.numel() * 4 > 1 << 20) and len(alone) == 6


def test_sender_dying_mid_stream_leaves_the_old_weights_serving(cluster, hf_model, tmp_path):
    before = cluster.ask("greedy")
    version = next_version(cluster)
    state = perturbed(hf_model, seed=2, path=tmp_path / "w.safetensors")
    with pytest.raises(WeightSyncError, match=rf"weight version {version} not received after [1-9]\d* buckets"):
        cluster.sync(version, tmp_path / "w.safetensors", stop_after=len(state) // 2, how="die")
    assert cluster.last_report == ("died", 17)
    assert cluster.ask("version") == (version - 1, version - 1)
    assert cluster.ask("greedy") == before

    cluster.sync(version, tmp_path / "w.safetensors")  # a restarted trainer, a fresh group: the same version lands
    assert cluster.ask("greedy") == hf_greedy(hf_model, state) != before


def test_stalled_sender_times_out_and_the_next_sync_works(cluster, hf_model, tmp_path):
    before = cluster.ask("greedy")
    version = next_version(cluster)
    state = perturbed(hf_model, seed=3, path=tmp_path / "w.safetensors")
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match=rf"weight version {version} not received after [1-9]\d* buckets.*"
                                              r"(?i:timed out)"):
        cluster.sync(version, tmp_path / "w.safetensors", stop_after=len(state) // 2, how="stall")
    assert time.monotonic() - started < TIMEOUT_S + 5
    assert cluster.last_report[0] == "error"  # the trainer's next broadcast found the group dropped
    assert cluster.ask("version") == (version - 1, version - 1) and cluster.ask("greedy") == before

    cluster.sync(version, tmp_path / "w.safetensors")
    assert cluster.ask("greedy") == hf_greedy(hf_model, state) != before


def test_wrong_layouts_and_versions_are_refused_before_anything_is_applied(cluster, hf_model, tmp_path):
    from safetensors.torch import save_file

    before = cluster.ask("greedy")
    version = next_version(cluster)
    state = perturbed(hf_model, seed=4, path=tmp_path / "good.safetensors")
    q = "model.layers.1.self_attn.q_proj.weight"
    bad = {
        "transposed": ({**state, q: state[q].t().contiguous()},
                       rf"'{q}' has shape \(256, 64\); the engine serves \(64, 256\)"),
        "unknown": ({**state, "model.layers.2.mlp.up_proj.weight": state[q].clone()},
                    r"'model.layers.2.mlp.up_proj.weight' is not a parameter the engine serves"),
        "missing": ({k: v for k, v in state.items() if k != "model.norm.weight"},
                    r"the stream ended without 1 parameters the engine serves: model.norm.weight"),
    }
    for name, (weights, message) in bad.items():
        save_file(weights, str(tmp_path / f"{name}.safetensors"))
        with pytest.raises(WeightSyncError, match=rf"^weight version {version} not received.*: {message}$"):
            cluster.sync(version, tmp_path / f"{name}.safetensors")
    with pytest.raises(WeightSyncError, match=rf"the sender streamed weight version {version + 5}, "
                                              rf"expected {version}$"):
        cluster.sync(version, tmp_path / "good.safetensors", send_version=version + 5)
    with pytest.raises(WeightSyncError, match=rf"weight version {version - 1} is not above the served version"):
        cluster.ask("sync", version - 1)
    assert cluster.ask("version") == (version - 1, version - 1) and cluster.ask("greedy") == before

    cluster.sync(version, tmp_path / "good.safetensors")
    assert cluster.ask("greedy") == hf_greedy(hf_model, state)


# ---- the wire alone, in one process: bucket bounds, laziness, abort ----

def _pair(bucket_bytes, served, version, stream):
    """Send ``stream`` from this thread to a receiver in another; returns (sent, received, receiver error)."""
    store = host_store("127.0.0.1", 0, 10.0)
    endpoint = SyncEndpoint("127.0.0.1", store.port, 0, 2, "gloo", 10.0, bucket_bytes)
    out = {}

    def receive():
        try:
            out["received"] = BucketReceiver(endpoint, 1, store).receive(version, served)
        except WeightSyncError as e:
            out["error"] = e

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    sender = BucketSender(endpoint)
    try:
        out["sent"] = sender.send(version, stream)
    except ValueError as e:
        out["sender_error"] = e
    thread.join(timeout=WAIT_S)
    assert not thread.is_alive()
    sender.close()
    return out


SPECS = [  # name, dtype, shape; 64 KiB buckets
    ("a", torch.float32, (100, 100)),  # 40000 bytes
    ("b", torch.bfloat16, (6000,)),  # 12000: fits beside a (52000)
    ("c", torch.int64, (2000,)),  # 16000: would make 68000, so a and b go out
    ("big", torch.float32, (20000,)),  # 80000 > 64 KiB: c goes out, then big alone
    ("flag", torch.bool, (7,)),
    ("s", torch.float32, ()),  # at offset 16
    ("h", torch.float16, (3, 5)),  # at 32
    ("e", torch.float32, (16000,)),  # at 64, ends at 64064 <= 65536
]


def _tensor(i, dtype, shape):
    g = torch.Generator().manual_seed(i)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(-10**12, 10**12, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def test_buckets_hold_at_most_bucket_bytes_and_the_sender_keeps_no_packed_tensor():
    served = ServedWeights({n: s for n, _, s in SPECS}, frozenset(n for n, _, _ in SPECS))
    refs = []

    def stream():
        for i, (name, dtype, shape) in enumerate(SPECS):
            # Consumed lazily, and nothing packed is held: of what was yielded, only the tensor the
            # sender's loop last saw may still be alive.
            assert not any(r() is not None for r in refs[:-1]), "the sender holds tensors it has packed"
            refs.append(weakref.ref(t := _tensor(i, dtype, shape)))
            yield name, t
            del t

    out = _pair(64 * 1024, served, 3, stream())
    assert "error" not in out, out.get("error")
    assert [(b.names, b.nbytes) for b in out["sent"]] == [
        (("a", "b"), 52000), (("c",), 16000), (("big",), 80000), (("flag", "s", "h", "e"), 64064)]
    for i, (name, dtype, shape) in enumerate(SPECS):
        got = out["received"][name]
        assert got.dtype == dtype and tuple(got.shape) == shape and torch.equal(got, _tensor(i, dtype, shape))


def test_a_failing_trainer_iterator_aborts_the_stream_with_its_reason():
    served = ServedWeights({n: s for n, _, s in SPECS}, frozenset(n for n, _, _ in SPECS))

    def stream():
        for i, (name, dtype, shape) in enumerate(SPECS[:4]):
            yield name, _tensor(i, dtype, shape)
        raise ValueError("gather of layer 3 failed")

    out = _pair(64 * 1024, served, 9, stream())
    assert str(out["sender_error"]) == "gather of layer 3 failed"
    assert re.fullmatch(r"weight version 9 not received after 3 buckets \(4 tensors\): "
                        r"the sender aborted: ValueError: gather of layer 3 failed", str(out["error"]))


def test_a_port_in_use_and_an_unreachable_store_fail_in_one_line_naming_the_address():
    store = host_store("127.0.0.1", 0, 5.0)
    with pytest.raises(WeightSyncError, match=rf"^cannot host the weight-sync store on 127.0.0.1:{store.port}: .*in use"):
        host_store("127.0.0.1", store.port, 5.0)
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"^could not join the weight-sync group weight_sync/0 at 127.0.0.1:1 as "
                                              r"rank 0 within 1 s: [^\n]*$"):
        BucketSender(SyncEndpoint("127.0.0.1", 1, 0, 2, "gloo", 1.0, 1024))
    assert time.monotonic() - started < 5

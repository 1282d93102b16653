"""A full disk (issue 40, item 3): a checkpoint that does not fit leaves nothing behind and the
previous one resumes; training, checkpointing and the signal workers back off with one warning per
stretch and resume by themselves when space is back; the gateway's 507s are logged once per stretch.

The disk is full by fault injection that always works: the exact errors a full tmpfs gave
(safetensors' "No space left on device (os error 28)", SQLite's SQLITE_FULL) raised while a flag is set."""
from __future__ import annotations

import asyncio
import logging
import shutil
import sqlite3
import subprocess
import time

import httpx
import pytest
from safetensors import SafetensorError

import clawrl.checkpoints as checkpoints
from clawrl.backoff import Backoff
from clawrl.checkpoints import CheckpointStore
from clawrl.config import compose
from clawrl.storage_faults import storage_fault
from clawrl.store import TurnStore
from clawrl.trainers.torch_trainer import TorchTrainer
from clawrl.workers import PollingWorker
from engine_testing import make_model_dir

NO_SPACE = "Error while serializing: I/O error: No space left on device (os error 28)"


def sqlite_full() -> sqlite3.Error:
    """A genuine SQLITE_FULL, as a write to a full disk raises it."""
    c = sqlite3.connect(":memory:")
    c.execute("PRAGMA max_page_count = 2")
    try:
        c.execute("CREATE TABLE t (x)")
        c.execute("INSERT INTO t VALUES (zeroblob(100000))")
    except sqlite3.Error as e:
        return e
    raise AssertionError("max_page_count did not fill the database")


class FullDisk:
    """While ``checkpoints_full``, a checkpoint's weights file is half written and then refused;
    while ``store_full``, every turn-store transaction is refused. Counts the refusals."""

    def __init__(self, monkeypatch):
        self.checkpoints_full = self.store_full = False
        self.refused = 0
        real_save, real_tx = checkpoints.save_file, TurnStore.transaction

        def save_file(tensors, path, metadata=None):
            if self.checkpoints_full:
                self.refused += 1
                with open(path, "wb") as f:
                    f.write(b"\0" * 1000)
                raise SafetensorError(NO_SPACE)
            return real_save(tensors, path, metadata=metadata)

        def transaction(store):
            if self.store_full:
                raise sqlite_full()
            return real_tx(store)

        monkeypatch.setattr(checkpoints, "save_file", save_file)
        monkeypatch.setattr(TurnStore, "transaction", transaction)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("disk_full_model") / "q3", "qwen3", seed=5)


def test_full_disk_errors_of_every_writer_are_storage_faults():
    assert storage_fault(SafetensorError(NO_SPACE)) == "the disk is full"
    assert storage_fault(sqlite_full()) == "the disk is full"
    try:  # torch's writer raises a RuntimeError while the OSError is being handled
        try:
            raise OSError(122, "Disk quota exceeded")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    except RuntimeError as e:
        assert storage_fault(e) == "the disk quota is exceeded"
    assert storage_fault(RuntimeError("unexpected pos 576 vs 534")) is None
    assert storage_fault(OSError(2, "No such file or directory")) is None


def test_a_checkpoint_that_does_not_fit_leaves_nothing_behind_and_the_previous_one_resumes(
        model_dir, tmp_path, monkeypatch):
    disk = FullDisk(monkeypatch)
    cfg = compose(["model.device=cpu", "train.save_every=1"])
    trainer = TorchTrainer(cfg, str(model_dir))
    store = CheckpointStore(tmp_path, cfg.train)
    trainer.step = 1
    store.save(trainer, 1)
    disk.checkpoints_full = True
    trainer.step = 2
    with pytest.raises(SafetensorError) as e:
        store.save(trainer, 2)
    assert storage_fault(e.value) == "the disk is full"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["VERSION", "step_1"]
    fresh = TorchTrainer(cfg, str(model_dir))
    assert CheckpointStore(tmp_path, cfg.train).resume(fresh).checkpoint.name == "step_1"

    disk.checkpoints_full = False  # space is back: the same step saves, whole and loadable
    assert store.save(trainer, 2).name == "step_2"
    store.load(2)


def test_temporaries_a_crash_left_are_removed_at_start_in_one_line(model_dir, tmp_path, caplog):
    cfg = compose(["model.device=cpu"])
    trainer = TorchTrainer(cfg, str(model_dir))
    store = CheckpointStore(tmp_path, cfg.train)
    trainer.step = 1
    store.save(trainer, 1)
    root = tmp_path / "checkpoints"
    (root / ".tmp-step_2-4242").mkdir()
    (root / ".tmp-step_2-4242" / "weights.safetensors").write_bytes(b"\0" * 4096)
    (root / ".VERSION.tmp").write_text("{")
    (root / "step_1" / ".manifest.json.tmp").write_text("{")
    with caplog.at_level(logging.INFO, logger="clawrl.checkpoints"):
        assert store.resume(TorchTrainer(cfg, str(model_dir))).checkpoint.name == "step_1"
    assert sorted(p.name for p in root.iterdir()) == ["VERSION", "step_1"]
    assert not list((root / "step_1").glob(".*"))
    removed = [r for r in caplog.records if "temporary" in r.getMessage()]
    assert len(removed) == 1 and "3 temporary" in removed[0].getMessage()


def test_a_disk_full_stretch_warns_once_backs_off_to_a_cap_and_says_when_space_is_back(caplog):
    now = [0.0]
    backoff = Backoff("training", "training pauses", first_s=1, max_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="clawrl.backoff"):
        delays = []
        for _ in range(9):
            delays.append(backoff.failed(sqlite_full()))
            now[0] += delays[-1]
        backoff.succeeded()
        backoff.succeeded()  # outside a stretch: nothing to say
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0][0] == "WARNING" and "the disk is full" in lines[0][1] and "training pauses" in lines[0][1]
    assert lines[1][0] == "INFO" and lines[1][1].startswith("disk space is back") and "9 attempt" in lines[1][1]
    assert backoff.delay_s() == 0


def test_other_errors_log_one_traceback_then_one_line_each_with_the_count(caplog):
    backoff = Backoff("judge worker", "judging pauses")
    with caplog.at_level(logging.INFO, logger="clawrl.backoff"):
        for _ in range(3):
            backoff.failed(ValueError("a bug"))
    assert [r.exc_info is not None for r in caplog.records] == [True, False, False]
    assert "3 times" in caplog.records[-1].getMessage()


class RecordingWorker(PollingWorker):
    """One item whose result cannot be recorded while the disk is full."""

    name = "test worker"

    def __init__(self, disk: dict):
        super().__init__(concurrency=1, poll_s=0.01)
        self.disk, self.attempts, self.recorded = disk, 0, False

    async def _next_work(self, free, busy):
        return [] if self.recorded or busy else [(1, self._record())]

    async def _record(self):
        self.attempts += 1
        if self.disk["full"]:
            raise sqlite_full()
        self.recorded = True


def test_a_worker_whose_writes_are_refused_backs_off_instead_of_spinning_and_resumes(caplog):
    disk = {"full": True}
    worker = RecordingWorker(disk)
    worker.backoff.first_s = 0.1

    async def scenario():
        worker.start()
        await asyncio.sleep(1.2)  # 0.1 + 0.2 + 0.4 s of backoff: four attempts, not hundreds
        full_attempts = worker.attempts
        disk["full"] = False
        deadline = time.monotonic() + 5
        while not worker.recorded and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await worker.stop()
        return full_attempts

    with caplog.at_level(logging.INFO, logger="clawrl.backoff"):
        full_attempts = asyncio.run(scenario())
    assert 2 <= full_attempts <= 5, full_attempts
    assert worker.recorded
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "test worker cannot write: the disk is full" in warnings[0].getMessage()
    assert sum(r.getMessage().startswith("disk space is back") for r in caplog.records) == 1


def test_a_full_disk_pauses_checkpointing_and_training_answers_507_and_everything_resumes(
        tmp_path, monkeypatch, caplog):
    from gateway_support import ServerThread, build_tiny_model, model_cache_dir
    from test_learner import interaction, make_app, status, wait_for

    disk = FullDisk(monkeypatch)
    app, learner, store = make_app(build_tiny_model(model_cache_dir()), tmp_path)
    learner.backoff.first_s = 0.2
    root = tmp_path / "checkpoints"
    acked = []
    with caplog.at_level(logging.INFO), ServerThread(app) as srv:
        interaction(srv.url, "Hi", "Thanks!")
        interaction(srv.url, "Tell me a story about a cat.", "No, that's wrong.")
        wait_for(srv.url, lambda s: s["training"]["train_step"] == 1 and (root / "step_1").is_dir())

        disk.checkpoints_full = True  # room for turns, not for a checkpoint
        interaction(srv.url, "Hi there", "Great, thanks.")
        interaction(srv.url, "Tell me a joke.", "That's not funny.")
        s = wait_for(srv.url, lambda s: s["training"]["storage_fault"] == "the disk is full")
        assert s["training"]["train_step"] == 2 and s["weight_version"] == 2  # served, its checkpoint owed
        interaction(srv.url, "Hello", "Thanks!")
        interaction(srv.url, "Say something.", "Wrong.")
        wait_for(srv.url, lambda s: s["training"]["samples"]["ready"] == 2)
        time.sleep(1.0)
        s = status(srv.url)
        assert s["training"]["train_step"] == 2, "training went on while its checkpoint was refused"
        assert 2 <= disk.refused <= 5, disk.refused  # backed off, never spun
        assert not [p.name for p in root.iterdir() if p.name.startswith(".")]  # no temporary left

        disk.store_full = True  # now nothing fits: chats are refused with 507
        for i in range(3):
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": f"full {i}"}]})
            assert r.status_code == 507, r.text

        disk.checkpoints_full = disk.store_full = False  # space is back
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "room again"}]})
        assert r.status_code == 200, r.text
        acked.append(int(r.headers["x-turn-ids"]))
        wait_for(srv.url, lambda s: s["training"]["train_step"] == 3 and s["training"]["storage_fault"] is None)
    store.close()
    assert CheckpointStore(tmp_path).steps()[:2] == [3, 2]
    CheckpointStore(tmp_path).load(3)
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    for part in ("training", "the turn store"):
        warned = [m for level, m in messages if level == "WARNING" and m.startswith(f"{part} cannot write")]
        back = [m for level, m in messages if m.startswith(f"disk space is back: {part} writes again")]
        assert len(warned) == 1 and len(back) == 1, (part, messages)
    assert any("3 attempt(s) refused" in m for _, m in messages if m.startswith("disk space is back: the turn"))
    assert not [m for level, m in messages if level == "ERROR"], messages
    stored = TurnStore(tmp_path, create=False)
    try:
        turns = {t["turn_id"]: t for t in stored.iter_turns()}
        assert all(turns[t]["status"] == "complete" for t in acked)
        assert len(turns) == 13  # six interactions of two turns, and the one after space came back
    finally:
        stored.close()


def mounted_tmpfs(path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_on_a_real_full_tmpfs_a_checkpoint_fails_cleanly_and_saves_once_there_is_room(model_dir, tmp_path):
    from required_tools import skip_unless_available

    run = tmp_path / "run"
    skip_unless_available("tmpfs", "mounting a tmpfs needs root", available=mounted_tmpfs(run, "64m"))
    try:
        cfg = compose(["model.device=cpu", "train.save_every=1"])
        trainer = TorchTrainer(cfg, str(model_dir))
        store = CheckpointStore(run, cfg.train)
        trainer.step = 1
        size = sum(f.stat().st_size for f in store.save(trainer, 1).iterdir())
        ballast = run / "ballast"
        with open(ballast, "wb") as f:  # fill the disk up to half a checkpoint's room
            free = shutil.disk_usage(run).free
            f.write(b"\0" * max(0, free - size // 2))
        trainer.step = 2
        with pytest.raises(Exception) as e:
            store.save(trainer, 2)
        assert storage_fault(e.value) == "the disk is full", repr(e.value)
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["VERSION", "step_1"]
        assert shutil.disk_usage(run).free >= size // 4  # what the failed write took is back
        ballast.unlink()
        assert store.save(trainer, 2).name == "step_2"
        store.load(2)
    finally:
        subprocess.run(["umount", "-l", str(run)], check=False)

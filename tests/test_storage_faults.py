"""Storage faults (issue 20, item 5): a full disk and a read-only run directory give clear errors,
corrupt nothing and lose no acknowledged turn.

The full disk is the server's own file-size limit (RLIMIT_FSIZE, which root cannot ignore the way it
ignores chmod; CPython ignores SIGXFSZ, so a write past it fails with EFBIG, as on a full disk).
The read-only run directory is a read-only bind mount in a private mount namespace."""
from __future__ import annotations

import os
import resource
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from clawrl.storage_faults import storage_fault
from clawrl.store import TurnStore

from gateway_support import build_tiny_model, free_port, model_cache_dir
from required_tools import skip_unless_available

CLAWRL = [sys.executable, "-c", "import sys; from clawrl.cli import main; sys.exit(main())"]
FILE_LIMIT = 300_000  # bytes: a few turns fill the WAL up to it


def test_storage_faults_are_told_from_bugs():
    full = sqlite3.connect(":memory:")
    full.execute("PRAGMA max_page_count = 2")
    with pytest.raises(sqlite3.Error) as e:
        full.execute("CREATE TABLE t (x)")
        full.execute("INSERT INTO t VALUES (zeroblob(100000))")
    assert storage_fault(e.value) == "the disk is full"
    with pytest.raises(sqlite3.Error) as e:
        full.execute("SELECT * FROM no_such_table")
    assert storage_fault(e.value) is None  # a bug, not the disk: stays an internal error
    assert storage_fault(ValueError("disk I/O error")) is None


def serve(run_dir: Path, model: Path, port: int, log: Path, limit_bytes: int | None = None,
          prefix: list[str] = ()) -> subprocess.Popen:
    def limit():
        if limit_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.RLIM_INFINITY))
    with open(log, "w") as out:
        return subprocess.Popen([*prefix, *CLAWRL, "serve", f"model.path={model}", "model.name=tiny",
                                 f"server.port={port}", f"run_dir={run_dir}", "engine.threads=1",
                                 "logging.wandb.mode=disabled"],
                                stdout=out, stderr=subprocess.STDOUT, preexec_fn=limit)


def wait_up(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + 90
    while time.time() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("serve did not come up: " + log.read_text()[-3000:])


def chat(url: str, i: int, stream: bool = False) -> httpx.Response:
    content = f"note {i}: " + os.urandom(400).hex()  # incompressible, about 900 prompt tokens
    return httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 4, "stream": stream, "messages": [{"role": "user", "content": content}]})


@pytest.mark.slow
def test_a_full_disk_answers_507_keeps_every_acknowledged_turn_and_recovers_when_there_is_room(tmp_path):
    model = build_tiny_model(model_cache_dir())
    run_dir, log, port = tmp_path / "run", tmp_path / "serve.log", free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(run_dir, model, port, log, limit_bytes=FILE_LIMIT)
    acked: list[int] = []
    try:
        wait_up(url, proc, log)
        refused = None
        for i in range(80):
            r = chat(url, i)
            if r.status_code != 200:
                refused = r
                break
            acked.append(int(r.headers["x-turn-ids"]))
        assert refused is not None and len(acked) >= 1, "the limit was never reached"
        assert refused.status_code == 507, refused.text
        err = refused.json()["error"]
        assert err["code"] == "storage_unavailable" and err["type"] == "server_error"
        assert "nothing of it was stored" in err["message"]
        assert chat(url, 999).status_code == 507  # still full: still a clear refusal, the server is up
        streamed = chat(url, 998, stream=True)  # a stream says it in its error event
        assert "storage_unavailable" in streamed.text or streamed.status_code == 507

        # room again (the operator freed space): the same server stores turns again, no restart
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        r = chat(url, 1000)
        assert r.status_code == 200, r.text
        acked.append(int(r.headers["x-turn-ids"]))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    printed = log.read_text()
    assert "the turn store cannot write: " in printed and "internal error" not in printed

    with sqlite3.connect(run_dir / "clawrl.sqlite") as c:
        assert c.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    store = TurnStore(run_dir, create=False)
    try:
        stored = {t["turn_id"]: t for t in store.iter_turns()}
        assert all(stored[t]["status"] == "complete" for t in acked)  # every acknowledged turn survived
        assert len(stored) == len(acked)  # and nothing half-stored from the refused ones
    finally:
        store.close()


@pytest.mark.slow
def test_a_read_only_run_dir_is_refused_in_one_line_and_left_unchanged(tmp_path):
    skip_unless_available("unshare")
    model = build_tiny_model(model_cache_dir())
    run_dir, port = tmp_path / "run", free_port()
    store = TurnStore(run_dir)  # an existing run
    store.close()
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    script = (f'mount --bind {run_dir} {run_dir} && mount -o remount,bind,ro {run_dir} && exec "$@"')
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *CLAWRL, "serve",
                           f"model.path={model}", "model.name=tiny", f"server.port={port}", f"run_dir={run_dir}",
                           "engine.threads=1", "logging.wandb.mode=disabled"],
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines and lines[-1].startswith("clawrl: "), proc.stderr[-3000:]
    assert "read-only" in lines[-1] and str(run_dir) in lines[-1], lines[-1]
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before

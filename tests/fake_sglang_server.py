"""A stand-in for SGLang 0.5.23's HTTP server, for tests/test_sglang_distributed.py (run as a script:
it prints its port, then serves until killed).

Held to SGLang's installed source, read with ``ast`` (tests/sglang_source.py): a POST is accepted
only on a route SGLang's http_server.py defines, and its JSON body must name only fields of the
request class that route's handler takes, give every required one and pick Literal fields among
their values; anything else is answered 422 with the reason, as FastAPI would. What SGLang's
scheduler does is emulated where the adapter depends on it: pause state, the weight-update session
(``update_weights_from_distributed`` outside ``begin_weight_update``/``end_weight_update`` fails, as
in 0.5.23). The weights-update group is SGLang's own code, compiled from its source:
``init_custom_process_group`` joins the trainer's group, and ``WeightUpdater.receive_weights_from_
distributed`` with ``FlattenedTensorBucket`` receives each broadcast; "loading" keeps the tensors.

Test hooks (not SGLang's): GET /_log (every request, in order), GET /_weights (the loaded tensors as
float64 lists), POST /_refuse {"route": ..., "after": n} (answer the route's (n+1)-th call with
success false, once).
"""
from __future__ import annotations

import ast
import importlib.util
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import sglang_source as ss  # noqa: E402

ROOT = ss.root()
IO = ss.classes(ROOT / "srt/managers/io_struct.py")
ROUTES = ss.http_routes(ROOT / "srt/entrypoints/http_server.py")


def _load_tensor_bucket():
    """SGLang's tensor_bucket.py (it imports only torch), loaded by path."""
    spec = importlib.util.spec_from_file_location("sglang_tensor_bucket", ROOT / "srt/weight_sync/tensor_bucket.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sglang_worker():
    """SGLang's weight updater's group code, bound to a CPU 'worker' (tp rank 0)."""
    bucket = _load_tensor_bucket()
    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    init_group = ss.function(ROOT / "srt/utils/common.py", "init_custom_process_group",
                             {"torch": torch, "torch_release": release})
    path = ROOT / "srt/model_executor/model_runner_components/weight_updater.py"
    ns = {"torch": torch, "FlattenedTensorBucket": bucket.FlattenedTensorBucket}
    receive = ss.function(path, "receive_weights_from_distributed", ns, cls="WeightUpdater")
    receive_bucketed = ss.function(path, "_receive_bucketed_weights_from_distributed", ns, cls="WeightUpdater")
    worker = SimpleNamespace(tp_rank=0, device="cpu", _model_update_group={})
    worker._receive_bucketed_weights_from_distributed = lambda **kw: receive_bucketed(worker, **kw)
    return worker, init_group, lambda **kw: receive(worker, **kw)


def check_body(route: str, body) -> str | None:
    """Why SGLang's server would refuse ``body`` on ``route``; None when it accepts it."""
    if route not in ROUTES:
        return f"no route {route} in SGLang's http_server.py"
    cls = ROUTES[route]
    if cls is None:
        return None if not body else f"{route} takes no body"
    if not isinstance(body, dict):
        return f"{cls} needs a JSON object"
    fields = ss.fields(IO, cls)
    extra = sorted(set(body) - set(fields))
    if extra:
        return f"{cls} has no field {extra}"
    missing = sorted(ss.required(fields) - set(body))
    if missing:
        return f"{cls} needs {missing}"
    for name, value in body.items():
        ann = fields[name].annotation
        if "Literal" in ast.unparse(ann) and value not in ss.literal_values(fields[name]):
            return f"{cls}.{name}={value!r} is not one of {sorted(ss.literal_values(fields[name]))}"
    return None


class State:
    def __init__(self):
        self.lock = threading.Lock()
        self.log: list[dict] = []
        self.paused = False
        self.session = False
        self.weights: dict[str, torch.Tensor] = {}
        self.version = "default"
        self.refuse: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.worker, self.init_group, self.receive = _sglang_worker()

    def handle(self, route: str, body) -> tuple[int, dict]:
        reason = check_body(route, body)
        with self.lock:
            self.log.append({"route": route, "body": body, "refused": reason})
            n = self.calls.get(route, 0)
            self.calls[route] = n + 1
        if reason:
            return 422, {"detail": reason}
        if self.refuse.get(route) == n:
            del self.refuse[route]
            return 400, {"success": False, "message": f"refused by the test on call {n + 1}"}
        if route == "/pause_generation":
            self.paused = True
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if route == "/continue_generation":
            self.paused = False
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if route == "/flush_cache":
            return 200, {}
        if route == "/begin_weight_update":
            if self.session:
                return 400, {"success": False, "message": "a weight-update session is already open"}
            self.session = True
            return 200, {"success": True, "message": "Success"}
        if route == "/end_weight_update":
            if not self.session:
                return 400, {"success": False, "message": "no weight-update session is open"}
            self.session = False
            return 200, {"success": True, "message": "Success"}
        if route == "/init_weights_update_group":
            try:
                rank = body["rank_offset"] + self.worker.tp_rank
                host = f"[{body['master_address']}]" if ":" in body["master_address"] else body["master_address"]
                self.worker._model_update_group[body["group_name"]] = self.init_group(
                    backend=body.get("backend", "nccl"), init_method=f"tcp://{host}:{body['master_port']}",
                    world_size=body["world_size"], rank=rank, group_name=body["group_name"])
            except Exception as e:
                return 400, {"success": False, "message": f"Failed to initialize custom process group: {e}."}
            return 200, {"success": True, "message": "Succeeded to initialize custom process group."}
        if route == "/destroy_weights_update_group":
            group = self.worker._model_update_group.pop(body.get("group_name", "weight_update_group"), None)
            if group is None:
                return 400, {"success": False, "message": "The group to be destroyed does not exist."}
            try:
                torch.distributed.destroy_process_group(group)
            except Exception:
                pass
            return 200, {"success": True, "message": "Succeeded to destroy custom process group."}
        if route == "/update_weights_from_distributed":
            if not self.session:
                return 400, {"success": False, "message": "update_weights_from_distributed must run between "
                             "begin_weight_update() and end_weight_update()"}
            try:
                received = self.receive(names=body["names"], dtypes=body["dtypes"], shapes=body["shapes"],
                                        group_name=body.get("group_name", "weight_update_group"),
                                        load_format=body.get("load_format"))
            except Exception as e:
                return 400, {"success": False, "message": f"Failed to receive weights: {e}"}
            for name, tensor in received:
                self.weights[name] = tensor.clone()
            if body.get("weight_version") is not None:
                self.version = body["weight_version"]
            return 200, {"success": True, "message": "Succeeded to update parameter online."}
        return 404, {"detail": f"{route} is not emulated"}


def serve() -> None:
    state = State()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, status: int, payload) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/_log":
                return self._answer(200, state.log)
            if self.path == "/_weights":
                return self._answer(200, {"version": state.version, "paused": state.paused,
                                          "weights": {k: [str(v.dtype), list(v.shape), v.double().flatten().tolist()]
                                                      for k, v in state.weights.items()}})
            self._answer(404, {})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                return self._answer(422, {"detail": "body is not JSON"})
            route = self.path.split("?")[0]
            if route == "/_refuse":
                state.refuse[body["route"]] = state.calls.get(body["route"], 0) + int(body.get("after", 0))
                return self._answer(200, {})
            status, payload = state.handle(route, body)
            self._answer(status, payload)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    serve()

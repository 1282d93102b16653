"""The SGLang adapter held to SGLang's own source (requirements-sglang.txt: sglang 0.5.23).

Most tests read the installed source with ``ast``: every request the adapter builds must use only
fields of the SGLang class it is for (with valid literal values), the methods it calls on SGLang's
TokenizerManager must exist with the arguments passed, and every key it reads from a response must
appear literally in SGLang's source. The adapter's parsing is then run on responses shaped as
SGLang's tokenizer manager builds them. One test constructs every request through SGLang's own
classes, in a subprocess on requirements-sglang-io-struct.txt (tests/sglang_requests_check.py says
why not in this process). ``CLAWRL_REQUIRE=sglang`` (CI) turns a skip for a missing sglang or a
missing io_struct install into a failure. The last test runs a real SGLang engine, opt-in.
"""
from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from clawrl.engines import sglang_engine as se
from clawrl.engines.base import EngineError, SamplingParams
from clawrl.paths import data_dir
from tests import sglang_source
from tests.sglang_requests_check import BUCKET, GROUP
from tests.sglang_requests_check import requests as _requests
from tests.required_tools import skip_unless_available

SPEC = importlib.util.find_spec("sglang")  # finds the package without importing it
ADAPTER = Path(se.__file__)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def src() -> Path:
    skip_unless_available("sglang", "sglang is not installed (pip install --no-deps -r requirements-sglang.txt)",
                          available=SPEC is not None)
    root = Path(SPEC.submodule_search_locations[0])
    version = importlib.metadata.version("sglang")
    assert version == "0.5.23", f"requirements-sglang.txt pins sglang 0.5.23, installed: {version}"
    return root


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}


def _fields(classes: dict[str, ast.ClassDef], name: str) -> dict[str, ast.AnnAssign]:
    """A class's annotated fields, its module-local bases' included (msgspec Structs, dataclasses)."""
    cls, out = classes[name], {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out.update(_fields(classes, base.id))
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


def _literal_values(ann: ast.AnnAssign) -> set[str]:
    return {n.value for n in ast.walk(ann.annotation) if isinstance(n, ast.Constant) and isinstance(n.value, str)}




def test_every_request_field_is_a_field_of_sglangs_class(src):
    classes = _classes(src / "srt/managers/io_struct.py")
    for name, reqs in _requests().items():
        fields = _fields(classes, name)
        for req in reqs:
            extra = set(req) - set(fields)
            assert not extra, f"{name} has no field {sorted(extra)} in sglang's io_struct.py"
            # a field without a default must be given
            required = {f for f, a in fields.items() if a.value is None and f not in ("rid", "http_worker_ipc")}
            assert required <= set(req), f"{name} needs {sorted(required - set(req))}"
    # the pause keeps requests: retract is one of SGLang's modes, and not its default (abort)
    mode = _fields(classes, "PauseGenerationReqInput")["mode"]
    assert se.PAUSE_MODE in _literal_values(mode) and ast.literal_eval(mode.value) == "abort" != se.PAUSE_MODE
    # the weight version SGLang stores is a string
    assert "str" in ast.unparse(_fields(classes, "UpdateWeightsFromTensorReqInput")["weight_version"].annotation)


def test_engine_arguments_are_fields_of_sglangs_server_args(src):
    """``sglang.Engine(**kwargs)`` takes ServerArgs fields, declared in arg_groups/fields/*.py."""
    from clawrl.config import compose

    declared = set()
    for f in (src / "srt/arg_groups/fields").glob("*.py"):
        for cls in _classes(f).values():
            declared |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for overrides, extra in (([], {}), (["model.device=cuda:2", "model.dtype=bfloat16", "engine.max_context=512"],
                                        {"base_gpu_id": 2, "dtype": "bfloat16", "context_length": 512}),
                             (["model.device=cpu"], {"device": "cpu"})):
        kwargs = se.engine_kwargs(compose(["engine.backend=sglang", *overrides]), "/m")
        assert set(kwargs) <= declared, f"ServerArgs has no {sorted(set(kwargs) - declared)}"
        assert kwargs == {"model_path": "/m", "skip_tokenizer_init": True, "random_seed": kwargs["random_seed"], **extra}


def test_sampling_params_are_sglangs(src):
    fields = _fields(_classes(src / "srt/sampling/sampling_params.py"), "SamplingParams")
    for reqs in _requests().values():
        for req in reqs:
            extra = set(req.get("sampling_params", {})) - set(fields)
            assert not extra, f"SamplingParams has no field {sorted(extra)}"
    # a request without top_k leaves SGLang's default (all tokens) rather than a guessed sentinel
    assert "top_k" not in se.sampling_params(SamplingParams())


def _methods(path: Path) -> dict[str, list[str]]:
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.setdefault(node.name, [a.arg for a in node.args.args + node.args.kwonlyargs])
    return out


def test_control_operations_are_sglangs_classes_methods_and_routes(src):
    """Each control operation: its io_struct class, the TokenizerManager method of that name taking
    the request object (and the FastAPI request where SGLang answers (success, message)), and the
    HTTP route whose handler takes that class as its body."""
    classes = _classes(src / "srt/managers/io_struct.py")
    methods = {}
    for f in ("tokenizer_manager.py", "tokenizer_control_mixin.py"):
        for k, v in _methods(src / "srt/managers" / f).items():
            methods.setdefault(k, v)
    routes = sglang_source.http_routes(src / "srt/entrypoints/http_server.py")
    for op, (cls, route) in se.CONTROL_OPS.items():
        assert cls in classes, f"io_struct has no {cls}"
        assert op in methods, f"TokenizerManager has no {op}"
        assert route in routes, f"SGLang's HTTP server has no POST {route}"
        if op == "flush_cache":  # the manager builds the request from timeout_s; the route takes a query
            assert methods[op][1:] == ["timeout_s"] and routes[route] is None
            continue
        assert routes[route] == cls, f"POST {route} takes {routes[route]}, not {cls}"
        expected = ["obj"] if op in se._NO_VERDICT else ["obj", "request"]
        assert methods[op][1:] == expected, f"TokenizerManager.{op}{methods[op]}"
    # SGLang 0.5.23 refuses tensor and distributed loads outside a weight-update session, hence begin/end
    sched = (src / "srt/managers/scheduler_components/weight_updater.py").read_text()
    for load in ("update_weights_from_distributed", "update_weights_from_tensor"):
        assert f"{load} must run between " in sched
    # a bucket is received as one flat byte tensor when load_format says so
    runner = (src / "srt/model_executor/model_runner_components/weight_updater.py").read_text()
    assert f'load_format == "{se.FLATTENED_BUCKET}"' in runner
    # SGLang's workers join as rank_offset + tp_rank: the trainer is rank 0, they start at 1
    assert "rank = rank_offset + self.tp_rank" in runner and se.init_group_request(GROUP)["rank_offset"] == 1


def test_tokenizer_manager_methods_exist_with_the_arguments_passed(src):
    mgr = src / "srt/managers"
    methods = {}
    for f in ("tokenizer_manager.py", "tokenizer_control_mixin.py"):
        for k, v in _methods(mgr / f).items():
            methods.setdefault(k, v)
    calls = {}  # what the adapter calls on self._tm, and with which keywords
    for node in ast.walk(ast.parse(ADAPTER.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "_tm"):
            calls.setdefault(node.func.attr, set()).update(k.arg for k in node.keywords)
            calls[node.func.attr].add(len(node.args))
    assert {"generate_request", "abort_request", "flush_cache"} <= set(calls)  # the rest: CONTROL_OPS
    for name, used in calls.items():
        assert name in methods, f"TokenizerManager has no method {name}"
        params = methods[name][1:]  # without self
        kws = {u for u in used if isinstance(u, str)}
        npos = max((u for u in used if isinstance(u, int)), default=0)
        assert kws <= set(params), f"{name}({params}) has no argument {sorted(kws - set(params))}"
        assert npos <= len(params), f"{name}({params}) takes fewer than {npos} positional arguments"


def _string_literals(root: Path) -> set[str]:
    out = set()
    for f in [root] if root.is_file() else root.rglob("*.py"):
        with warnings.catch_warnings():  # SGLang's own invalid escapes, not ours
            warnings.simplefilter("ignore", DeprecationWarning)
            tree = ast.parse(f.read_text(errors="replace"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.add(node.value)
    return out


def _keys_read_by_adapter() -> set[str]:
    """String keys the adapter subscripts or ``.get``s (what it reads from SGLang's responses)."""
    keys = set()
    for node in ast.walk(ast.parse(ADAPTER.read_text())):
        if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
            keys.add(node.slice.value)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            keys.add(node.args[0].value)
    return keys


def test_every_key_the_adapter_reads_is_in_sglangs_source(src):
    read = _keys_read_by_adapter()
    assert {"meta_info", "output_token_logprobs", "finish_reason", "completion_tokens"} <= read
    assert read <= set(se.RESPONSE_KEYS), f"the adapter reads keys not in RESPONSE_KEYS: {sorted(read - set(se.RESPONSE_KEYS))}"
    literals = _string_literals(src / "srt")
    missing = [k for k in se.RESPONSE_KEYS if k not in literals]
    assert not missing, f"keys the adapter reads that sglang {SPEC.origin} never writes: {missing}"
    # the finish types it maps are SGLang's FINISH_*.to_json() types
    finish = _string_literals(src / "srt/managers/schedule_batch.py")
    assert set(se.FINISH_TYPES) <= finish
    # meta_info is built in the tokenizer manager with these keys, each written literally as a dict key
    tm = ast.parse((src / "srt/managers/tokenizer_manager.py").read_text())
    dict_keys = {k.value for n in ast.walk(tm) if isinstance(n, ast.Dict) for k in n.keys
                 if isinstance(k, ast.Constant)}
    assert {"finish_reason", "completion_tokens", "cached_tokens", "weight_version", "meta_info"} <= dict_keys
    # the HTTP server answers a weight or group request with {"success": ..., "message": ...}
    http = ast.parse((src / "srt/entrypoints/http_server.py").read_text())
    answers = [{k.value for k in n.keys if isinstance(k, ast.Constant)} for n in ast.walk(http) if isinstance(n, ast.Dict)]
    assert {"success", "message"} in answers


def _meta(tokens, lps, completion, finish=None, version="default", cumulative=True, cached=0):
    """A meta_info as SGLang 0.5.23's tokenizer manager sends it: logprobs as (logprob, id, text)."""
    rows = [(lp, t, None) for t, lp in zip(tokens, lps)]
    return {"id": "r", "finish_reason": finish, "prompt_tokens": 3, "weight_version": version,
            "completion_tokens": completion, "cached_tokens": cached, "output_token_logprobs": rows}


def test_parse_stream_exact_tokens_logprobs_and_versions():
    # cumulative chunks: each lists every logprob so far
    m1 = _meta([5, 6], [-0.5, -0.25], 2, cached=2)
    c1, seen = se.parse_chunk(m1, 0, 0, fallback_version=0, first=True)
    assert (c1.token_ids, c1.logprobs, c1.weight_versions, c1.cached_prompt_tokens) == ([5, 6], [-0.5, -0.25], [0, 0], 2)
    m2 = _meta([5, 6, 9], [-0.5, -0.25, -1.5], 3, finish={"type": "length", "length": 3}, version="4")
    c2, seen = se.parse_chunk(m2, seen, 0, fallback_version=0, first=False)
    assert (c2.token_ids, c2.logprobs, c2.weight_versions, c2.finish_reason, seen) == ([9], [-1.5], [4], "length", 3)
    assert c2.cached_prompt_tokens == 0
    # incremental chunks give the same tokens
    c3, _ = se.parse_chunk(_meta([9], [-1.5], 3, finish={"type": "stop", "matched": 2}), 2, 0, 7, False)
    assert (c3.token_ids, c3.weight_versions, c3.finish_reason, c3.matched_stop) == ([9], [7], "stop", 2)
    c4, _ = se.parse_chunk(_meta([], [], 3, finish={"type": "abort", "message": "x"}), 3, 0, 0, False)
    assert (c4.token_ids, c4.finish_reason) == ([], "abort")
    with pytest.raises(EngineError, match="2 new tokens but 1 logprobs"):
        se.parse_chunk(_meta([1], [-1.0], 2), 0, 0, 0, True)
    # top logprobs: rows of (logprob, id, text)
    m = _meta([5], [-0.5], 1)
    m["output_top_logprobs"] = [[(-0.5, 5, None), (-1.0, 8, None)]]
    c5, _ = se.parse_chunk(m, 0, 2, 0, True)
    assert c5.top_logprobs == [[(5, -0.5), (8, -1.0)]]


def test_requests_carry_the_token_in_token_out_contract():
    p = SamplingParams(max_new_tokens=4, top_logprobs=3)
    g = se.generate_request([1, 2, 3], p, "rid")
    assert (g["input_ids"], g["return_logprob"], g["logprob_start_len"], g["stream"], g["top_logprobs_num"]) == \
        ([1, 2, 3], True, 3, True, 3)
    s = se.score_request([1, 2], [3], 0, 0.5)
    assert s["sampling_params"]["max_new_tokens"] == 0 and s["logprob_start_len"] == 2 and "top_logprobs_num" not in s
    assert se.update_from_tensor_request(b"p", 9)["weight_version"] == "9"


def test_not_importable_sglang_is_a_clear_error(src):
    try:
        import sglang  # noqa: F401
    except Exception:
        with pytest.raises(EngineError, match="^SGLang is installed but does not import"):
            se._import_sglang()
    else:
        assert se._import_sglang() is not None


def _import_error(module: str) -> str | None:
    """Why ``module`` does not import here (its first line), or None when it does."""
    import sys

    if "sglang" not in sys.modules:  # an earlier failed import can leave sglang.srt behind without sglang
        for name in [m for m in sys.modules if m.startswith("sglang.")]:
            del sys.modules[name]
    try:
        importlib.import_module(module)
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


IO_STRUCT_INSTALL = ('pip install --no-deps --require-hashes --upgrade --target "$CLAWRL_HOME/sglang-io-struct" '
                     '-r requirements-sglang-io-struct.txt')


def _io_struct_dir() -> Path | None:
    """``$CLAWRL_HOME/sglang-io-struct`` (requirements-sglang-io-struct.txt) when it is installed."""
    target = data_dir() / "sglang-io-struct"
    return target if (target / "torchvision").is_dir() and (target / "msgspec").is_dir() else None


def test_every_request_is_built_through_sglangs_own_classes(src):
    """Every request the adapter builds is constructed through the adapter's own path into SGLang's
    class, survives SGLang's IPC encoding with its types checked, and a generate request passes
    SGLang's normalisation and sampling-parameter checks; a misspelt field is refused by SGLang's
    class. In a subprocess (tests/sglang_requests_check.py says why); under CLAWRL_REQUIRE=sglang a
    missing io_struct install fails instead of skipping."""
    deps = _io_struct_dir()
    skip_unless_available("sglang", f"SGLang's io_struct dependencies are not installed ({IO_STRUCT_INSTALL})",
                          available=deps is not None)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(deps), str(ROOT / "core"), str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "tests.sglang_requests_check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["checked"] == {name: len(reqs) for name, reqs in _requests().items()}
    assert report["misspelt_field_refused"] is True
    if not torch.cuda.is_available():  # PyPI's torchvision beside the CPU torch: its faked operators declared
        assert report["declared_torchvision_operators"] == ["nms", "qnms"]


@pytest.mark.sglang_server
def test_real_sglang_server_generate_score_and_swap():
    """Opt-in: a GPU machine with SGLang's full install (its kernels import) and CLAWRL_SGLANG_MODEL,
    an HF model directory. Skipped otherwise, also under CLAWRL_REQUIRE=sglang (that requires the
    sglang package, which CI installs; its kernels cannot install on our machines)."""
    why = _import_error("sgl_kernel") or _import_error("sglang.srt.managers.io_struct")
    if why:
        pytest.skip(f"SGLang's kernels do not import here ({why}): needs a GPU machine with SGLang's full install")
    if not os.environ.get("CLAWRL_SGLANG_MODEL"):
        pytest.skip("set CLAWRL_SGLANG_MODEL to an HF model directory to run a real SGLang engine")
    import asyncio
    from pathlib import Path as P

    from safetensors.torch import load_file

    from clawrl.config import compose

    path = os.environ["CLAWRL_SGLANG_MODEL"]

    async def go():
        eng = se.SGLangEngine(compose(["engine.backend=sglang", f"model.path={path}"]))
        try:
            greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
            r = await eng.generate([1, 2, 3], greedy)
            assert len(r.token_ids) == len(r.logprobs) == len(r.weight_versions) > 0
            sc = await eng.score([1, 2, 3], r.token_ids)
            assert max(abs(a - b) for a, b in zip(sc.logprobs, r.logprobs)) < 0.05
            # the model's own weights, pushed as version 1: the same greedy tokens, now labelled 1
            state = {}
            for f in sorted(P(path).glob("*.safetensors")):
                state.update(load_file(str(f)))
            await eng.update_weights(state, 1)
            r2 = await eng.generate([1, 2, 3], greedy)
            assert r2.token_ids == r.token_ids and set(r2.weight_versions) == {1}
            assert (await eng.health())["weight_version"] == 1 and not (await eng.health())["paused"]
        finally:
            await eng.shutdown()

    asyncio.run(go())


def test_an_sglang_request_stops_at_every_end_of_turn_id_unless_it_ignores_eos():
    """SGLang stops at the config's eos only; SmolLM2's ``<|endoftext|>`` must reach it as a stop id."""
    eng = object.__new__(se.SGLangEngine)  # no SGLang process: only the request it would be sent
    eng.eos_ids, eng.max_context = [0, 2], 1024
    eng._stream = lambda prompt, params, rid: params
    assert eng.stream([1], SamplingParams(stop_token_ids=(5,))).stop_token_ids == (0, 2, 5)
    assert eng.stream([1], SamplingParams(ignore_eos=True)).stop_token_ids == ()

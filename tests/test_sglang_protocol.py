"""The SGLang adapter held to SGLang's own source (requirements-sglang.txt: sglang 0.5.23).

SGLang's request classes cannot be imported here: ``sglang.srt.managers.io_struct`` imports
torchvision (through schedule_batch and its model configs), and PyPI's torchvision links CUDA torch.
So these tests read the installed source with ``ast``: every request the adapter builds must use
only fields of the SGLang class it is for (with valid literal values), the methods it calls on
SGLang's TokenizerManager must exist with the arguments passed, and every key it reads from a
response must appear literally in SGLang's source. The adapter's parsing is then run on responses
shaped as SGLang's tokenizer manager builds them. ``CLAWRL_REQUIRE=sglang`` (CI) turns the skip
for a missing sglang into a failure. The last test runs a real SGLang engine, opt-in.
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import warnings
from pathlib import Path

import pytest

from clawrl.engines import sglang_engine as se
from clawrl.engines.base import EngineError, SamplingParams
from tests.required_tools import skip_unless_available

SPEC = importlib.util.find_spec("sglang")  # finds the package without importing it
ADAPTER = Path(se.__file__)


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


def _requests():
    p = SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=20, stop=("\n",),
                       stop_token_ids=(7,), seed=3, top_logprobs=2, ignore_eos=True)
    return {
        "GenerateReqInput": [se.generate_request([1, 2, 3], p, "r1"), se.score_request([1, 2], [3, 4], 2, 1.0)],
        "UpdateWeightsFromTensorReqInput": [se.update_from_tensor_request(b"x", 4)],
        "UpdateWeightFromDiskReqInput": [se.update_from_disk_request("/m", 4)],
        "PauseGenerationReqInput": [se.pause_request()],
        "ContinueGenerationReqInput": [se.continue_request()],
    }


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
    assert {"generate_request", "abort_request", "pause_generation", "continue_generation", "flush_cache",
            "update_weights_from_tensor", "update_weights_from_disk"} <= set(calls)
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


def _kernels_import() -> bool:
    try:
        import sgl_kernel  # noqa: F401
        import sglang.srt.managers.io_struct  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.sglang_server
def test_real_sglang_server_generate_score_and_swap():
    """Opt-in: a GPU machine with SGLang's kernels and CLAWRL_SGLANG_MODEL (an HF model directory)."""
    if not os.environ.get("CLAWRL_SGLANG_MODEL") or not _kernels_import():
        pytest.skip("needs sglang's kernels and CLAWRL_SGLANG_MODEL")
    import asyncio

    from clawrl.config import compose

    async def go():
        eng = se.SGLangEngine(compose(["engine.backend=sglang", f"model.path={os.environ['CLAWRL_SGLANG_MODEL']}"]))
        try:
            r = await eng.generate([1, 2, 3], SamplingParams(max_new_tokens=8, temperature=1.0, seed=0))
            assert len(r.token_ids) == len(r.logprobs) == len(r.weight_versions) > 0
            sc = await eng.score([1, 2, 3], r.token_ids)
            assert max(abs(a - b) for a, b in zip(sc.logprobs, r.logprobs)) < 0.05
            state = {}
            await eng.update_weights(state, 1)
            r2 = await eng.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
            assert set(r2.weight_versions) == {1}
        finally:
            await eng.shutdown()

    asyncio.run(go())

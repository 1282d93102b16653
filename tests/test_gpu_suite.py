"""benchmarks/gpu_suite.py at its tiny CPU size, so the GPU benchmark cannot rot: it runs the
decode, prefill and serving parts end to end (serving through a real uvicorn server and the HTTP
client process) and writes every key the results file promises."""
from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"


def load_suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_suite_runs_tiny_on_cpu_and_writes_its_keys(tmp_path, capsys):
    suite = load_suite()
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"other": {"kept": 1}}))  # figures are merged into an existing file
    assert suite.main(["--shape", "tiny", "--repeat", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["other"] == {"kept": 1}
    for n in (1, 4):
        d = res["decode"][f"streams_{n}"]
        assert d["clawrl_tok_s"] > 0 and d["hf_tok_s"] > 0 and d["clawrl_greedy_tok_s"] > 0
        assert d["ratio"] == pytest.approx(d["clawrl_tok_s"] / d["hf_tok_s"], rel=1e-2)
        assert d["commit"] and d["command"].startswith("python benchmarks/gpu_suite.py --shape tiny")
    p = res["prefill"]["openclaw"]
    assert p["clawrl_ms"] > 0 and p["hf_ms"] > 0
    assert p["ratio_to_hf"] == pytest.approx(p["clawrl_ms"] / p["hf_ms"], rel=1e-2)
    assert 0 < p["cached_tokens"] < p["tokens"]  # the hit really came from the prefix cache
    assert p["cold_beside_decoding_ms"] > 0 and p["decoding_streams"] == 8
    for n in (2, 4):  # every chat got all its tokens through HTTP (the suite checks the count)
        s = res["serving"][f"chats_{n}"]
        assert s["gateway_tok_s"] > 0 and s["engine_tok_s"] > 0
        # rounded to 3 decimals: absolute slack for a small ratio (a busy CPU)
        assert s["ratio"] == pytest.approx(s["gateway_tok_s"] / s["engine_tok_s"], rel=1e-2, abs=1e-3)
        assert 0 < s["gateway_ttft_p50_ms"] <= s["gateway_latency_p50_ms"]
        assert 0 < s["engine_ttft_p50_ms"] <= s["engine_latency_p50_ms"]
        assert s["prompt_tokens_mean"] > 20 and s["new_tokens"] == 8 and s["engine_generate_tok_s"] > 0
        assert all(s["per_request_alone"][k] > 0 for k in ("render_ms", "link_begin_ms", "link_record_ms"))
        assert s["commit"] and s["command"].startswith("python benchmarks/gpu_suite.py --shape tiny")
    t = res["train"]  # the trainer against the probe's HF loop, with every variant
    assert t["hf"]["tok_s"] > 0 and t["tokens_per_step"] == 4 * 64
    for key in ("torch", "torch_gradient_checkpointing", "torch_two_micro_batches", "torch_float32_params_autocast",
                "torch_compiled_parts", "torch_eager", "torch_compiled_layer"):
        assert t[key]["tok_s"] > 0 and t[key]["ratio_to_hf"] == pytest.approx(t["hf"]["step_s"] / t[key]["step_s"])
        assert t[key]["packed_attention"] and t[key]["commit"]
    assert t["torch_two_micro_batches"]["micro_batches"] == 2 and t["torch"]["micro_batches"] == 1
    # train.compile's default (auto) compiles on a GPU only
    assert t["torch_compiled_parts"]["compiled_modules"] == 10 and t["torch_eager"]["compiled_modules"] == 0
    assert t["torch_compiled_layer"]["compiled_modules"] == 2  # the tiny shape's two layers, whole
    assert t["torch"]["compiled_modules"] == 0
    # the directory's own defaults apply (none), not the embedded model's KL reference: one forward a step
    assert t["torch"]["pi_old_from_loss_forward"]
    m = t["megatron"]  # the megatron backend on the same directory and samples, against the torch trainer
    assert m["tok_s"] > 0 and m["ratio_to_torch"] == pytest.approx(t["torch"]["step_s"] / m["step_s"])
    assert m["micro_batches"] == 1 and m["pi_old_from_loss_forward"] and m["commit"]
    assert m["compiled_modules"] == 0 and t["megatron_eager"]["compiled_modules"] == 0  # auto: eager on CPU
    assert t["megatron_eager"]["ratio_to_torch"] > 0
    assert t["megatron_parts"]["compiled_modules"] == 10  # train.compile=on, the tiny shape's norms and MLPs
    s = res["sync"]  # on CPU only gloo, its staged bytes checked against the sent ones
    assert s["gloo"]["ms"] > 0 and s["cross_process_ms"] == s["gloo"]["ms"] and "ipc" not in s
    # in process, into a started engine, checked against a reference model holding the same weights
    assert s["in_process_ms"] > 0 and s["in_process"]["served_equals_reference"] == [True]
    printed = capsys.readouterr().out
    assert "| HF loop (probe) |" in printed and "| gloo |" in printed and "| clawrl megatron backend" in printed
    assert "| decode, 1 stream(s)" in printed and "| cold prefill, OpenClaw request" in printed
    assert "| 4 | " in printed  # the serving table's row for 4 chats


def test_gpu_suite_decode_part_leaves_prefill_alone(tmp_path):
    suite = load_suite()
    out = tmp_path / "r.json"
    earlier = {"openclaw": {"clawrl_ms": 1.0, "hf_ms": 2.0, "ratio_to_hf": 0.5, "hit_ms": 0.1, "hit_over_cold": 0.1,
                            "tokens": 9}}
    out.write_text(json.dumps({"prefill": earlier}))
    assert suite.main(["--part", "decode", "--shape", "tiny", "--repeat", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["prefill"] == earlier and "streams_4" in res["decode"] and "serving" not in res
    # another decode attention goes under its own key, beside the default's figures
    assert suite.main(["--part", "decode", "--shape", "tiny", "--repeat", "1", "--decode-attention", "triton",
                       "--out", str(out)]) == 0
    res2 = json.loads(out.read_text())
    assert res2["decode"] == res["decode"] and res2["decode_triton"]["streams_1"]["decode_attention"] == "triton"


def test_serving_conversations_differ_and_have_the_asked_length():
    suite = load_suite()
    tok = suite.chat_tokenizer(None, Path(tempfile.mkdtemp()))
    convs = suite.serving_conversations(tok, 5, 300)
    texts = [c[0]["content"] for c in convs]
    assert len(set(texts)) == 5 and all(c[0]["role"] == "user" for c in convs)
    lengths = [len(tok.encode(t, add_special_tokens=False)) for t in texts]
    assert all(200 < n < 400 for n in lengths), lengths


def test_gpu_rollouts_runs_tiny_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_rollouts", SUITE.with_name("gpu_rollouts.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "r.json"
    assert mod.main(["--seconds", "0.5", "--groups-in-flight", "1", "--group-size", "2", "--out", str(out),
                     "sandbox.backend=subprocess", "sandbox.allow_unisolated=true"]) == 0
    r = json.loads(out.read_text())["rollouts"]["toolcall"]
    assert r["episodes"] >= 2 and r["episodes"] % 2 == 0 and r["episodes_per_min"] > 0
    assert r["counts"]["ok"] == r["episodes"] and r["turns_per_episode"] >= 1  # no episode failed
    assert r["command"].startswith("python benchmarks/gpu_rollouts.py --seconds 0.5")


def test_gpu_suite_hybrid_part_runs_tiny_on_cpu(tmp_path, capsys):
    suite = load_suite()
    out = tmp_path / "r.json"
    assert suite.main(["--part", "hybrid", "--shape", "tiny", "--repeat", "1", "--out", str(out)]) == 0
    h = json.loads(out.read_text())["hybrid"]
    assert h["kernels"] == "torch" and h["commit"] and h["command"].startswith("python benchmarks/gpu_suite.py")
    assert h["hybrid"]["static_decode"] is False and h["hybrid_params"] > 0 and h["attention_params"] > 0
    for name in ("hybrid", "attention"):
        for n in (1, 4):
            assert h[name][f"streams_{n}"]["tok_s"] > 0 and h[name][f"streams_{n}"]["hf_tok_s"] > 0
        assert h[name]["prefill_ms"] > 0 and h[name]["train"]["tok_s"] > 0
    assert h["hybrid"]["train"]["micro_batches"] == 1 and not h["hybrid"]["train"]["packed_attention"]
    assert h["hybrid"]["train"]["linear_kernels"] == "torch" and h["attention"]["train"]["linear_kernels"] is None
    assert h["decode_ratio_streams_4"] == pytest.approx(h["hybrid"]["streams_4"]["tok_s"] / h["attention"]["streams_4"]["tok_s"],
                                                        rel=1e-2)
    assert "| hybrid (torch kernels) vs attention-only" in capsys.readouterr().out

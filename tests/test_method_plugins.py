"""A method from a file (``method=dir/file.py:ClassName``) loads like a built-in one and trains, in the
trainer and beside serving; a bad path or class is refused in one line before anything starts."""
from __future__ import annotations

import json
import textwrap

import pytest

from clawrl.config import ConfigError, compose
from clawrl.methods.registry import check_method, load_method
from clawrl.methods.rl import BinaryRL
from gateway_support import ServerThread, build_tiny_model, model_cache_dir
from test_learner import interaction, make_app, wait_for
from test_trainer import make_samples, model_dir, on_policy, trainer_for  # noqa: F401 (fixture)

FLIPPED = '''
from clawrl.methods.rl import BinaryRL


class FlippedRL(BinaryRL):
    """Binary RL that learns the opposite of what the judge says."""

    def advantages(self, batches):
        metrics = super().advantages(batches)
        for mb in batches:
            mb.advantages = -mb.advantages
        return metrics
'''


@pytest.fixture
def flipped(tmp_path):
    path = tmp_path / "plugins" / "flipped.py"
    path.parent.mkdir()
    path.write_text(FLIPPED)
    return f"{path}:FlippedRL"


def test_a_method_from_a_file_trains_one_step_with_its_own_advantages(model_dir, flipped):
    rl, flip = trainer_for(model_dir, "method=rl"), trainer_for(model_dir, f"method={flipped}")
    assert type(flip.method).__name__ == "FlippedRL" and isinstance(flip.method, BinaryRL)
    results = []
    for trainer in (rl, flip):
        samples = on_policy(trainer, make_samples(trainer.vocab_size, n=3, advantage=1.0))
        before = sum(sum(lps) for lps in trainer.logprobs(samples))
        result = trainer.train_step(samples, weight_version=0)
        assert result.ok, result.skipped_reason
        results.append((result.metrics, sum(sum(lps) for lps in trainer.logprobs(samples)) - before))
    (m_rl, moved_rl), (m_flip, moved_flip) = results
    # on-policy (ratio 1) the policy-gradient loss is linear in the advantage: it flips exactly
    assert m_flip["pg_loss"] == pytest.approx(-m_rl["pg_loss"], rel=1e-6)
    assert moved_rl > 0.01 and moved_flip < -0.01  # rewarded replies become likelier, flipped: rarer
    assert m_flip["samples_rl_only"] == m_rl["samples_rl_only"] == 3


def test_a_method_from_a_file_judges_and_trains_beside_serving(flipped, tmp_path):
    model = build_tiny_model(model_cache_dir())
    app, learner, store = make_app(model, tmp_path / "run", f"method={flipped}")
    assert type(learner.method).__name__ == "FlippedRL" and learner.buffer.readiness == BinaryRL(learner.cfg).readiness
    with ServerThread(app) as srv:
        interaction(srv.url, "Hi", "Thanks!")
        interaction(srv.url, "Tell me a story about a cat.", "No, that's wrong.")
        t = wait_for(srv.url, lambda s: s["training"]["train_step"] == 1)["training"]
    assert t["method"] == flipped and t["judge"] == "rules" and t["samples"]["trained"] == 2
    step = next(json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
                if '"kind": "train_step"' in line)
    assert step["samples_rl_only"] == 2


def test_a_relative_path_is_read_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text(FLIPPED)
    monkeypatch.chdir(tmp_path)
    method = load_method(compose(["method=mine.py:FlippedRL"]))
    assert isinstance(method, BinaryRL) and type(method).__name__ == "FlippedRL"


BAD_FILES = {
    "not_a_method.py": "class NotAMethod:\n    pass\n",
    "a_function.py": "def make():\n    return None\n",
    "broken.py": "import no_such_module_anywhere\n",
    "abstract.py": textwrap.dedent('''
        from clawrl.methods.base import Method

        class Half(Method):
            """Says when a sample is ready, and nothing else."""

            @property
            def readiness(self):
                from clawrl.buffer import Readiness
                return Readiness()
        '''),
}


@pytest.mark.parametrize("spec, message", [
    ("grpo", "unknown method 'grpo'; choose one of rl, opd, combine, or dir/file.py:ClassName"),
    ("{d}/missing.py:Nope", "method={d}/missing.py:Nope: no such file {d}/missing.py"),
    ("{d}/not_a_method.py", "method={d}/not_a_method.py: name the class in the file too"),
    ("{d}/not_a_method.py:Other", "method={d}/not_a_method.py:Other: not_a_method.py defines no 'Other'"),
    ("{d}/not_a_method.py:NotAMethod", "method={d}/not_a_method.py:NotAMethod: 'NotAMethod' is not a "
                                       "clawrl.methods.base.Method"),
    ("{d}/a_function.py:make", "'make' is not a clawrl.methods.base.Method"),
    ("{d}/broken.py:Anything", "importing {d}/broken.py failed: ModuleNotFoundError: No module named "
                               "'no_such_module_anywhere'"),
    ("{d}/abstract.py:Half", "'Half' leaves advantages, prepare unimplemented"),
])
def test_a_bad_method_is_refused_in_one_line(tmp_path, spec, message):
    for name, source in BAD_FILES.items():
        (tmp_path / name).write_text(source)
    spec, message = spec.format(d=tmp_path), message.format(d=tmp_path)
    with pytest.raises(ConfigError) as e:
        check_method(spec)
    assert message in str(e.value) and "\n" not in str(e.value)

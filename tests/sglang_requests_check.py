"""Every request the SGLang adapter builds, constructed through SGLang's own classes.

Run by ``tests/test_sglang_protocol.py`` in a subprocess (``python -m tests.sglang_requests_check``),
because importing ``sglang.srt.managers.io_struct`` needs torchvision (SGLang's model configs import
it at module level), and PyPI's torchvision wheel links CUDA torch: beside the CPU torch its C
operators do not load and its Python side stops at registering fake kernels for two of them
(``operator torchvision::nms does not exist``). transformers then fails to import any model class
in that process, and importing sglang patches transformers in place, so SGLang's dependencies live
in a directory of their own (requirements-sglang-io-struct.txt, installed with ``pip --target`` into
``$CLAWRL_HOME/sglang-io-struct``) that only this subprocess puts on its path.

Where torchvision's operators did not load, their schemas are declared here first, with no kernel:
torchvision's Python side imports, and any call of them still raises. SGLang's request classes never
call them. On a GPU image with a matching torchvision nothing is declared.

Prints one JSON line: the classes checked and how many requests of each.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from clawrl.engines import sglang_engine as se
from clawrl.engines.base import SamplingParams

GROUP = se.WeightGroup("10.0.0.1", 29600, 2, "clawrl_weights_x_0", "nccl")
BUCKET = se.BucketMeta(("model.norm.weight", "lm_head.weight"), ("bfloat16", "bfloat16"), ((8,), (16, 8)))
# torchvision operators whose fake kernels torchvision registers unconditionally on import
_TORCHVISION_SCHEMAS = {"nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                        "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"}


def requests() -> dict[str, list[dict]]:
    """SGLang class name -> the keyword arguments the adapter builds for it."""
    p = SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=20, stop=("\n",),
                       stop_token_ids=(7,), seed=3, top_logprobs=2, ignore_eos=True)
    return {
        "GenerateReqInput": [se.generate_request([1, 2, 3], p, "r1"), se.score_request([1, 2], [3, 4], 2, 1.0)],
        "UpdateWeightsFromTensorReqInput": [se.update_from_tensor_request(b"x", 4)],
        "UpdateWeightFromDiskReqInput": [se.update_from_disk_request("/m", 4)],
        "PauseGenerationReqInput": [se.pause_request()],
        "ContinueGenerationReqInput": [se.continue_request()],
        "BeginWeightUpdateReqInput": [se.begin_update_request()],
        "EndWeightUpdateReqInput": [se.end_update_request()],
        "InitWeightsUpdateGroupReqInput": [se.init_group_request(GROUP)],
        "DestroyWeightsUpdateGroupReqInput": [se.destroy_group_request(GROUP)],
        "UpdateWeightsFromDistributedReqInput": [se.update_from_distributed_request(BUCKET, GROUP, 4)],
    }


def declare_torchvision_operators() -> list[str]:
    """Declare the schemas of torchvision's unconditionally faked operators when its C extension does
    not load here (CPU torch), as torchvision's own loader would find. Returns the names declared.
    Must run before torchvision imports."""
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return []  # the import fails on its own, naming the missing package
    try:
        torch.ops.load_library(next(Path(spec.origin).parent.glob("_C*.so")))
        return []
    except (StopIteration, OSError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _TORCHVISION_SCHEMAS.values():
        lib.define(schema)
    declare_torchvision_operators.library = lib  # the registrations live as long as the library object
    return sorted(_TORCHVISION_SCHEMAS)


def check() -> dict:
    import msgspec
    from sglang.srt.managers import io_struct
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLSamplingParams

    checked: dict[str, int] = {}
    for name, reqs in requests().items():
        for kwargs in reqs:
            obj = se._sgl_request(name, kwargs)  # the adapter's own construction
            assert isinstance(obj, getattr(io_struct, name)), name
            assert all(getattr(obj, k) == v for k, v in kwargs.items()), name
            if isinstance(obj, msgspec.Struct):  # SGLang's IPC: msgpack, types checked on decode
                assert msgspec.msgpack.decode(msgspec.msgpack.encode(obj), type=type(obj)) == obj, name
            if name == "GenerateReqInput":
                obj.normalize_batch_and_arguments()
                assert obj.is_single and obj.input_ids == kwargs["input_ids"] and obj.return_logprob is True
                assert obj.logprob_start_len == kwargs["logprob_start_len"]
                SGLSamplingParams(**kwargs["sampling_params"]).verify(32000)
            checked[name] = checked.get(name, 0) + 1
    try:  # a misspelt field is refused by SGLang's class itself
        se._sgl_request("UpdateWeightsFromDistributedReqInput",
                        {**se.update_from_distributed_request(BUCKET, GROUP, 1), "flush": True})
    except TypeError:
        refused = True
    else:
        refused = False
    return {"checked": checked, "misspelt_field_refused": refused}


def main() -> int:
    declared = declare_torchvision_operators()
    print(json.dumps({**check(), "declared_torchvision_operators": declared}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

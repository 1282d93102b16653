"""Streaming HF-named weights from trainer rank 0 into SGLang, over SGLang's own weights-update group.

SGLang (``engine.backend=sglang``) loads weights from a torch process group it joins on request
(``init_weights_update_group``): the trainer is rank 0 and hosts the group's TCP rendezvous, and
SGLang's workers are ranks 1... For each bucket the driver, which holds the SGLang engine, sends
``update_weights_from_distributed`` with the bucket's names, dtypes and shapes, and SGLang's workers
receive one broadcast of the bucket's bytes (``flattened_bucket``: the tensors back to back, each at
a multiple of its dtype's size) and load it.

The trainer knows each bucket's layout only as it fills it, so rank 0 tells the driver: a JSON
header per bucket in the driver's store (``cluster.sync_port``, the store ``BroadcastWeightSync``
also uses), under ``sglang_sync/<token>/<generation>/<version>/<index>``, then the broadcast; after the last
bucket an ``end`` header with the counts, or ``abort`` with the reason when the trainer's iterator
fails. The driver reads each header, checks it against the names and shapes the engine serves and
asks SGLang to receive (``clawrl.weight_sync.SGLangWeightSync``). A bucket holds one dtype, so every
offset is aligned; a tensor larger than a bucket goes alone.

Failure: every store read and broadcast has ``timeout_s``; a failed push retires the generation (a
new group name and store prefix), as ``clawrl.weight_transport`` does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist

from clawrl.cluster import groups
from clawrl.weight_transport import SentBucket, WeightSyncError, one_line

KEY_PREFIX = "sglang_sync"


@dataclass(frozen=True)
class SGLangGroupEndpoint:
    """How trainer rank 0 joins one generation of SGLang's weights-update group, and where it posts
    the bucket headers; the driver hands it to ``send_weights``."""

    store_host: str  # the driver's store (bucket headers)
    store_port: int
    generation: int
    master_address: str  # where rank 0 hosts the group's rendezvous (SGLang connects there)
    master_port: int
    world_size: int  # the trainer plus SGLang's ranks
    backend: str  # nccl (GPUs) | gloo (CPU)
    timeout_s: float
    bucket_bytes: int
    token: str = "0"  # the driver's, so a restarted driver never reuses a group name SGLang still holds

    def __post_init__(self):
        if self.backend not in ("nccl", "gloo"):
            raise WeightSyncError(f"SGLang's weights-update group takes nccl or gloo, not '{self.backend}'")
        if self.world_size < 2 or self.timeout_s <= 0 or self.bucket_bytes <= 0:
            raise WeightSyncError(f"bad SGLang weight-sync endpoint: world size {self.world_size}, timeout "
                                  f"{self.timeout_s} s, bucket {self.bucket_bytes} bytes")

    @property
    def group_name(self) -> str:
        return f"clawrl_weights_{self.token}_{self.generation}"

    def key(self, version: int, index: int) -> str:
        return f"{KEY_PREFIX}/{self.token}/{self.generation}/{version}/{index}"

    def describe(self) -> str:
        return f"SGLang weights-update group {self.group_name} at {self.master_address}:{self.master_port}"

    def open_sender(self) -> "SGLangGroupSender":
        return SGLangGroupSender(self)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SGLangGroupSender:
    """Rank 0 of SGLang's weights-update group, in the process that holds the weights. The group is
    formed on the first ``send`` (SGLang joins it when the driver asks, at the same time); keep one
    sender per endpoint."""

    def __init__(self, endpoint: SGLangGroupEndpoint, device: torch.device | None = None):
        self.endpoint = endpoint
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if endpoint.backend == "nccl"
                                 else torch.device("cpu"))
        try:
            self._store = groups.join_store(endpoint.store_host, endpoint.store_port, endpoint.timeout_s)
        except Exception as e:
            raise WeightSyncError(f"cannot reach the driver's weight-sync store at {endpoint.store_host}:"
                                  f"{endpoint.store_port}: {one_line(e)}") from e
        self.group: dist.ProcessGroup | None = None
        self._buffer: torch.Tensor | None = None
        self._closed = False

    def _join(self) -> dist.ProcessGroup:
        if self._closed:
            raise WeightSyncError(f"the {self.endpoint.describe()} was closed after an earlier failure")
        if self.group is None:
            e = self.endpoint
            try:
                self.group = groups.sglang_update_group(e.master_address, e.master_port, e.world_size, e.group_name,
                                                        e.backend, e.timeout_s)
            except Exception as err:
                self._closed = True
                raise WeightSyncError(f"SGLang did not join the {e.describe()} within {e.timeout_s:g} s: "
                                      f"{one_line(err)}") from err
        return self.group

    def send(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[SentBucket]:
        """Stream ``named_tensors`` (HF names) as weight ``version``, then the end marker; the
        iterator is consumed one item at a time. If it raises, the driver is told why (``abort``)."""
        self._join()
        limit = self.endpoint.bucket_bytes
        sent: list[SentBucket] = []
        entries: list[tuple[str, torch.dtype, list[int]]] = []
        used = 0
        try:
            for name, tensor in named_tensors:
                nbytes = tensor.numel() * tensor.element_size()
                if entries and (tensor.dtype != entries[0][1] or used + nbytes > limit):
                    sent.append(self._send_bucket(version, len(sent), entries, self._buffer[:used]))
                    entries, used = [], 0
                if nbytes > limit:
                    payload = tensor.detach().to(self.device).contiguous().reshape(-1).view(torch.uint8)
                    sent.append(self._send_bucket(version, len(sent), [(name, tensor.dtype, list(tensor.shape))],
                                                  payload))
                    continue
                if self._buffer is None:
                    self._buffer = torch.empty(limit, dtype=torch.uint8, device=self.device)
                self._buffer[used:used + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
                entries.append((name, tensor.dtype, list(tensor.shape)))
                used += nbytes
            if entries:
                sent.append(self._send_bucket(version, len(sent), entries, self._buffer[:used]))
        except WeightSyncError as e:
            self.close()  # the group is broken; the driver, waiting for a header, hears why
            self._post(version, len(sent), {"kind": "abort", "reason": one_line(e)}, quiet=True)
            raise
        except Exception as e:
            self._post(version, len(sent), {"kind": "abort", "reason": f"{type(e).__name__}: {one_line(e)}"})
            raise
        self._post(version, len(sent), {"kind": "end", "buckets": len(sent),
                                        "tensors": sum(len(b.names) for b in sent)})
        return sent

    def _post(self, version: int, index: int, header: dict, quiet: bool = False) -> None:
        try:
            self._store.set(self.endpoint.key(version, index), json.dumps({**header, "version": version}))
        except Exception as e:
            if quiet:
                return
            self.close()
            raise WeightSyncError(f"cannot post a bucket header to the driver's store: {one_line(e)}") from e

    def _send_bucket(self, version: int, index: int, entries, payload: torch.Tensor) -> SentBucket:
        self._post(version, index, {"kind": "bucket", "names": [n for n, _, _ in entries],
                                    "dtypes": [dtype_name(d) for _, d, _ in entries],
                                    "shapes": [s for _, _, s in entries]})
        try:
            work = dist.broadcast(payload, src=0, group=self.group, async_op=True)
            work.wait(timedelta(seconds=self.endpoint.timeout_s))
        except Exception as e:
            self.close()
            raise WeightSyncError(f"broadcast of bucket {index + 1} ({payload.numel()} bytes) over the "
                                  f"{self.endpoint.describe()} failed: {one_line(e)}") from e
        return SentBucket(tuple(n for n, _, _ in entries), payload.numel())

    def close(self) -> None:
        """Drop the group (SGLang's side fails or is told to forget it) and the buffer."""
        self._closed = True
        group, self.group = self.group, None
        self._buffer = None
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except Exception:
                pass

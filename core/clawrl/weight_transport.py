"""Streaming HF-named weights from a trainer rank into a serving engine in another process.

Why a group of its own. Trainer ranks already use the default torch.distributed world for
megatron; the engine is not one of its ranks and must not become one, or every megatron collective
would wait for it. So the sender (trainer rank 0, group rank 0) and the receiving engine process
(group rank 1; further engines would be 2, 3, ...) form a separate group: a ``TCPStore`` hosted by
the driver, and a ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (CUDA) built directly on it,
never registered with torch.distributed, used only through its own ``broadcast``
(``clawrl.cluster.groups`` makes the store and the group).

Generations. The store lives as long as the driver; each group lives under its own store prefix,
``weight_sync/<generation>``. A healthy group serves push after push (an NCCL communicator costs
seconds to build), and any failure retires it: the next push hands out generation + 1, the sender
sees a new ``SyncEndpoint`` and builds a new group, and no stale key or half-read socket of the
broken one can reach it. A trainer that restarts while the driver keeps running still holds no
group: the push it meets fails once (its rank 0 cannot join a generation already formed) and the
next one rebuilds.

The stream. The sender consumes its ``(name, tensor)`` iterator lazily, so the trainer can gather
one parameter at a time, and copies each tensor into a byte buffer of ``bucket_bytes``; a bucket
goes out when the next tensor would not fit, and a tensor larger than a bucket goes alone, straight
from its own storage. The sender never holds more than one bucket and the current tensor, never a
full copy. Each message is three broadcasts: sizes (int64[2]), a JSON header (kind, version, and
for each tensor its name, dtype, shape and byte offset), then the payload. Messages are ``bucket``
..., then ``end`` with the counts, or ``abort`` with the reason when the trainer's iterator fails.
Bytes rather than a buffer per dtype: one collective per bucket, and every dtype crosses gloo and
NCCL alike. JSON rather than pickle: a header from the network never runs code.

Staging. The receiver checks every header against the names and shapes the engine serves before
it receives the payload, so a wrong layout is refused before a byte of it lands. Received tensors
are staged as views into their bucket's buffer, on the group's device (CPU for gloo, the engine's
GPU for NCCL); only after the end marker, with every served parameter present, does the driver
hand them to ``engine.update_weights``, which swaps them in between two decode steps. Loading
bucket by bucket into the live model would serve a mix of two versions whenever a stream broke
halfway; the price of atomicity is memory: the receiving process holds one staged copy of the
model, in the sent dtype, until the swap.

CUDA IPC (``backend="ipc"``): sender and engine share one GPU, where NCCL cannot put two ranks
(and gloo would carry every byte through host memory twice). The group is gloo and carries only the
messages; a bucket's payload stays on the GPU: the sender's header names its bucket's CUDA IPC
handle (the storage's ``cudaIpcMemHandle``, event and reference-counter handles, as torch shares
CUDA tensors between processes; base64 in the JSON), the receiver opens it and copies the bytes into
its own staging buffer, device to device, and a barrier tells the sender that it may refill the
bucket. A bucket is one big buffer (``cluster.bucket_mb``), so a handle is opened once per bucket.

Failure. Every blocking call (store connection, group formation, each broadcast) has
``timeout_s``. A sender that dies mid-stream closes its sockets and the receiver fails at once; one
that stalls fails at the timeout; a mismatch fails at its header. Each raises a one-line
``WeightSyncError`` naming what happened, the receiver drops its group (which fails the sender's
pending broadcast too), and nothing reaches the engine, which keeps serving the old version.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Mapping

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from clawrl.cluster import groups

MB = 1 << 20  # cluster.bucket_mb counts MiB
BACKENDS = ("gloo", "nccl", "ipc")
SENDER_RANK = 0
_ALIGN = 16  # each tensor starts at a multiple of this in its bucket, so any dtype views its bytes in place


class WeightSyncError(RuntimeError):
    """A weight sync that failed or was refused; the message is one line naming what happened."""


def one_line(e: BaseException) -> str:
    """An exception as one bounded line (gloo and c10d messages can run to several)."""
    text = " ".join(str(e).split())
    return (text[:300] + "...") if len(text) > 300 else (text or type(e).__name__)


@dataclass(frozen=True)
class SyncEndpoint:
    """How to join one generation of the weight-sync group; the driver hands it to the sender."""

    host: str  # the driver's address, where it hosts the TCPStore
    port: int
    generation: int  # the group's store prefix; a new one after every failure
    world_size: int  # the sender (rank 0) plus the receiving engine processes
    backend: str  # gloo (CPU tensors) | nccl (CUDA tensors) | ipc (one GPU: gloo messages, CUDA IPC payloads)
    timeout_s: float  # every connection and collective
    bucket_bytes: int  # largest bucket; a single larger tensor goes alone

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise WeightSyncError(f"weight-sync backend '{self.backend}' is not one of {', '.join(BACKENDS)}")
        if self.world_size < 2:
            raise WeightSyncError(f"a weight-sync group needs a sender and a receiver, not world size "
                                  f"{self.world_size}")
        if self.timeout_s <= 0 or self.bucket_bytes <= 0:
            raise WeightSyncError(f"weight-sync timeout ({self.timeout_s} s) and bucket size ({self.bucket_bytes} "
                                  "bytes) must be positive")

    @property
    def prefix(self) -> str:
        return f"weight_sync/{self.generation}"

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    def describe(self) -> str:
        return f"weight-sync group {self.prefix} at {self.host}:{self.port}"

    def open_sender(self) -> "BucketSender":
        """Rank 0's sender for this endpoint (``SGLangGroupEndpoint`` opens its own kind)."""
        return BucketSender(self)


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The driver's store for every weight-sync group; port 0 takes a free one (read ``.port``)."""
    try:
        return groups.host_store(host, port, timeout_s)
    except Exception as e:
        raise WeightSyncError(f"cannot host the weight-sync store on {host}:{port}: {one_line(e)}") from e


def join_group(endpoint: SyncEndpoint, rank: int, store: dist.Store | None = None) -> dist.Backend:
    """This process's member of the endpoint's group. ``store``: the driver's own store (the host);
    otherwise a client connection to it. Blocks until every rank has joined, at most the timeout."""
    try:
        if store is None:
            store = groups.join_store(endpoint.host, endpoint.port, endpoint.timeout_s)
        return groups.standalone_group(store, endpoint.prefix, rank, endpoint.world_size,
                                       "gloo" if endpoint.backend == "ipc" else endpoint.backend, endpoint.timeout_s)
    except Exception as e:
        raise WeightSyncError(f"could not join the {endpoint.describe()} as rank {rank} within "
                              f"{endpoint.timeout_s:g} s: {one_line(e)}") from e


class _Channel:
    """Broadcasts from the sender over one group, each bounded by the endpoint's timeout."""

    def __init__(self, endpoint: SyncEndpoint, rank: int, store: dist.Store | None, device: torch.device):
        self.endpoint, self.device = endpoint, device
        self.group: dist.Backend | None = join_group(endpoint, rank, store)

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        if self.group is None:
            raise WeightSyncError(f"the {self.endpoint.describe()} was closed after an earlier failure")
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = SENDER_RANK, 0
        try:
            self.group.broadcast([tensor], options).wait(self.endpoint.timeout)
        except Exception as e:
            self.close()
            raise WeightSyncError(f"broadcast of {what} over the {self.endpoint.describe()} failed (timeout "
                                  f"{self.endpoint.timeout_s:g} s): {one_line(e)}") from e

    @property
    def message_device(self) -> torch.device:
        """Where headers travel: the payload's device, except over IPC (gloo messages)."""
        return torch.device("cpu") if self.endpoint.backend == "ipc" else self.device

    def barrier(self, what: str) -> None:
        """Every rank got here (over IPC: the receiver has copied the bucket out of the sender's)."""
        if self.group is None:
            raise WeightSyncError(f"the {self.endpoint.describe()} was closed after an earlier failure")
        try:
            self.group.barrier(dist.BarrierOptions()).wait(self.endpoint.timeout)
        except Exception as e:
            self.close()
            raise WeightSyncError(f"{what} over the {self.endpoint.describe()} failed (timeout "
                                  f"{self.endpoint.timeout_s:g} s): {one_line(e)}") from e

    def send_message(self, header: dict, payload: torch.Tensor | None = None) -> None:
        nbytes = 0 if payload is None else payload.numel()
        if payload is not None and self.endpoint.backend == "ipc":
            header = {**header, "ipc": _ipc_handle(payload)}
        data = json.dumps(header).encode()
        where = self.message_device
        self.broadcast(torch.tensor([len(data), nbytes], dtype=torch.int64, device=where), "message sizes")
        self.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(where), "a header")
        if payload is not None and self.endpoint.backend == "ipc":
            self.barrier(f"the receiver's copy of a {header['kind']} ({nbytes} bytes)")
        elif payload is not None:
            self.broadcast(payload, f"{header['kind']} payload ({nbytes} bytes)")

    def receive_payload(self, header: dict, payload_len: int, what: str) -> torch.Tensor:
        """The payload that follows ``header``, in a buffer of this rank's own."""
        data = torch.empty(payload_len, dtype=torch.uint8, device=self.device)
        if self.endpoint.backend != "ipc":
            self.broadcast(data, what)
            return data
        try:
            shared = _open_ipc(header.get("ipc"), payload_len)
            data.copy_(shared)
            torch.cuda.current_stream(data.device).synchronize()  # copied before the sender may refill it
            del shared
        except WeightSyncError:
            self.close()
            raise
        except Exception as e:
            self.close()
            raise WeightSyncError(f"could not open the sender's CUDA IPC handle for {what}: {one_line(e)}") from e
        self.barrier(f"the copy of {what}")
        return data

    def receive_header(self) -> tuple[dict, int]:
        where = self.message_device
        sizes = torch.empty(2, dtype=torch.int64, device=where)
        self.broadcast(sizes, "message sizes")
        header_len, payload_len = (int(x) for x in sizes.cpu())
        data = torch.empty(header_len, dtype=torch.uint8, device=where)
        self.broadcast(data, "a header")
        try:
            header = json.loads(bytes(data.cpu().numpy()))
            assert isinstance(header, dict) and isinstance(header["kind"], str) and isinstance(header["version"], int)
        except Exception:
            raise WeightSyncError(f"malformed header from the {self.endpoint.describe()}") from None
        return header, payload_len

    def close(self) -> None:
        """Drop the group: its sockets close, so a peer blocked on it fails now, not at its timeout."""
        group, self.group = self.group, None
        if group is not None and self.endpoint.backend == "nccl":
            group.abort()  # a communicator with a kernel in flight must be aborted, not just released


def _default_device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend in ("nccl", "ipc") else torch.device("cpu")


def _ipc_handle(payload: torch.Tensor) -> dict:
    """What another process needs to open ``payload``'s CUDA storage (``torch.multiprocessing``'s
    own sharing of CUDA tensors), JSON-safe; the payload is synchronized first."""
    import base64

    from torch.multiprocessing.reductions import reduce_tensor

    if payload.device.type != "cuda":
        raise WeightSyncError("the ipc weight-sync backend needs the payload on a CUDA device")
    torch.cuda.current_stream(payload.device).synchronize()
    _, args = reduce_tensor(payload)
    (_, size, _, offset, _, _, device, handle, storage_bytes, storage_offset, _, counter, counter_offset,
     event, event_sync) = args
    b64 = lambda b: base64.b64encode(b).decode() if b is not None else None  # noqa: E731
    return {"device": int(device), "handle": b64(handle), "storage_bytes": int(storage_bytes),
            "storage_offset": int(storage_offset), "counter": b64(counter), "counter_offset": int(counter_offset),
            "event": b64(event), "event_sync": bool(event_sync), "offset": int(offset), "numel": int(size[0])}


def _open_ipc(ipc: dict | None, payload_len: int) -> torch.Tensor:
    """The sender's bucket as a uint8 tensor of this process (``_ipc_handle``'s inverse)."""
    import base64

    try:
        raw = lambda k: base64.b64decode(ipc[k]) if ipc[k] is not None else None  # noqa: E731
        storage = torch.UntypedStorage._new_shared_cuda(
            int(ipc["device"]), raw("handle"), int(ipc["storage_bytes"]), int(ipc["storage_offset"]),
            raw("counter"), int(ipc["counter_offset"]), raw("event"), bool(ipc["event_sync"]))
        offset, numel = int(ipc["offset"]), int(ipc["numel"])
    except (TypeError, KeyError, ValueError) as e:
        raise WeightSyncError(f"malformed CUDA IPC handle in a bucket header: {one_line(e)}") from None
    if numel != payload_len:
        raise WeightSyncError(f"the CUDA IPC bucket holds {numel} bytes, the header announced {payload_len}")
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{int(ipc['device'])}").set_(storage, offset, (numel,), (1,))


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class SentBucket:
    """What one broadcast carried: the tensor names, in order, and the payload size in bytes."""

    names: tuple[str, ...]
    nbytes: int


class BucketSender:
    """Group rank 0, in the process that holds the weights (megatron: global rank 0).

    Keep one per endpoint: build a new one (closing the old) when the driver hands out an endpoint
    that differs from ``self.endpoint``, which it does after any failure.
    """

    def __init__(self, endpoint: SyncEndpoint, device: torch.device | None = None):
        self.endpoint = endpoint
        self.device = device or _default_device(endpoint.backend)
        self._channel = _Channel(endpoint, SENDER_RANK, None, self.device)
        self._buffer: torch.Tensor | None = None

    def send(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[SentBucket]:
        """Stream ``named_tensors`` (HF names) as weight ``version``, then the end marker.

        The iterator is consumed one item at a time and no tensor is kept once copied into the
        bucket. If it raises, the receivers are told why (``abort``) and the error propagates.
        """
        limit = self.endpoint.bucket_bytes
        sent: list[SentBucket] = []
        entries: list[list] = []  # [name, dtype, shape, offset] of the bucket being filled
        used = 0
        try:
            for name, tensor in named_tensors:
                nbytes = tensor.numel() * tensor.element_size()
                if entries and _aligned(used) + nbytes > limit:
                    sent.append(self._send_bucket(version, entries, used))
                    entries, used = [], 0
                if nbytes > limit:
                    sent.append(self._send_alone(version, name, tensor))
                    continue
                offset = _aligned(used)
                if self._buffer is None:
                    self._buffer = torch.empty(limit, dtype=torch.uint8, device=self.device)
                self._buffer[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
                entries.append([name, _dtype_name(tensor.dtype), list(tensor.shape), offset])
                used = offset + nbytes
            if entries:
                sent.append(self._send_bucket(version, entries, used))
        except WeightSyncError:
            raise  # the group is broken: nothing more can be said on it
        except Exception as e:
            self._channel.send_message({"kind": "abort", "version": version,
                                        "reason": f"{type(e).__name__}: {one_line(e)}"})
            raise
        self._channel.send_message({"kind": "end", "version": version, "buckets": len(sent),
                                    "tensors": sum(len(b.names) for b in sent)})
        return sent

    def _send_bucket(self, version: int, entries: list[list], nbytes: int) -> SentBucket:
        self._channel.send_message({"kind": "bucket", "version": version, "tensors": entries}, self._buffer[:nbytes])
        return SentBucket(tuple(e[0] for e in entries), nbytes)

    def _send_alone(self, version: int, name: str, tensor: torch.Tensor) -> SentBucket:
        """A tensor larger than a bucket, from its own storage (a copy only to reach the device)."""
        payload = tensor.detach().to(self.device).contiguous().reshape(-1).view(torch.uint8)
        entry = [name, _dtype_name(tensor.dtype), list(tensor.shape), 0]
        self._channel.send_message({"kind": "bucket", "version": version, "tensors": [entry]}, payload)
        return SentBucket((name,), payload.numel())

    def close(self) -> None:
        self._channel.close()
        self._buffer = None


@dataclass(frozen=True)
class ServedWeights:
    """The HF names and shapes an engine serves: what every header is checked against."""

    shapes: Mapping[str, tuple[int, ...]]  # every name the engine accepts (tied aliases included)
    required: frozenset[str]  # what a full sync must carry (a tied weight once)

    @classmethod
    def of_model_dir(cls, path: str) -> "ServedWeights":
        """From the HF config alone: the model is built on the meta device, no weights read."""
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        return cls({k: tuple(v.shape) for k, v in model.state_dict().items()},
                   frozenset(name for name, _ in model.named_parameters()))

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        if name not in self.shapes:
            raise WeightSyncError(f"'{name}' is not a parameter the engine serves")
        if shape != self.shapes[name]:
            raise WeightSyncError(f"'{name}' has shape {shape}; the engine serves {self.shapes[name]}")


class BucketReceiver:
    """A receiving rank (1, 2, ...) in the engine's process: stages one version, applies nothing."""

    def __init__(self, endpoint: SyncEndpoint, rank: int, store: dist.Store | None = None,
                 device: torch.device | None = None):
        if not 0 < rank < endpoint.world_size:
            raise WeightSyncError(f"receiver rank {rank} is outside 1..{endpoint.world_size - 1}")
        self.endpoint = endpoint
        self.device = device or _default_device(endpoint.backend)
        self._channel = _Channel(endpoint, rank, store, self.device)

    def receive(self, version: int, served: ServedWeights) -> dict[str, torch.Tensor]:
        """The staged state of ``version``, once its end marker arrived and every served parameter
        is in it. On any failure the group is dropped and WeightSyncError says what happened."""
        staged: dict[str, torch.Tensor] = {}
        buckets = 0
        try:
            while True:
                header, payload_len = self._channel.receive_header()
                if header["version"] != version:
                    raise WeightSyncError(f"the sender streamed weight version {header['version']}, "
                                          f"expected {version}")
                if header["kind"] == "abort":
                    raise WeightSyncError(f"the sender aborted: {header.get('reason')}")
                if header["kind"] == "end":
                    missing = sorted(served.required - staged.keys())
                    if missing:
                        raise WeightSyncError(f"the stream ended without {len(missing)} parameters the engine "
                                              f"serves: {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}")
                    if (header.get("buckets"), header.get("tensors")) != (buckets, len(staged)):
                        raise WeightSyncError(f"the sender counted {header.get('buckets')} buckets and "
                                              f"{header.get('tensors')} tensors; {buckets} and {len(staged)} arrived")
                    return staged
                if header["kind"] != "bucket":
                    raise WeightSyncError(f"unknown message kind '{header['kind']}'")
                views = self._plan(header, payload_len, served, staged)
                data = self._channel.receive_payload(header, payload_len, f"bucket {buckets + 1} ({payload_len} bytes)")
                for name, (dtype, shape, start, stop) in views.items():
                    staged[name] = data[start:stop].view(dtype).view(shape)
                buckets += 1
        except WeightSyncError as e:
            self.close()
            where = f" after {buckets} buckets ({len(staged)} tensors)" if buckets else ""
            raise WeightSyncError(f"weight version {version} not received{where}: {e}") from e

    @staticmethod
    def _plan(header: dict, payload_len: int, served: ServedWeights, staged: Mapping[str, torch.Tensor]) -> dict:
        """Where each tensor of a bucket lies, after checking it against what the engine serves."""
        views = {}
        try:
            entries = [(str(n), str(d), tuple(int(x) for x in s), int(o)) for n, d, s, o in header["tensors"]]
        except (KeyError, TypeError, ValueError):
            raise WeightSyncError("malformed bucket header") from None
        for name, dtype_name, shape, offset in entries:
            served.check(name, shape)
            if name in staged or name in views:
                raise WeightSyncError(f"'{name}' arrived twice")
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise WeightSyncError(f"'{name}' has unknown dtype '{dtype_name}'")
            stop = offset + dtype.itemsize * int(torch.Size(shape).numel())
            if offset % dtype.itemsize or not 0 <= offset <= stop <= payload_len:
                raise WeightSyncError(f"'{name}' lies outside its bucket (bytes {offset}..{stop} of {payload_len})")
            views[name] = (dtype, shape, offset, stop)
        return views

    def close(self) -> None:
        self._channel.close()

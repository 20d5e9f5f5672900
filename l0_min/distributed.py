"""The process group, in one place: join torchrun's group (or make one of one) on the learner's device, end it
cleanly, small collectives, rank 0's messages to every rank, and why CUDA cannot be used where it cannot.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
from typing import NoReturn

import torch
import torch.distributed as dist


def init_distributed(backend: str = "auto", device: str = "auto") -> tuple[int, int, torch.device]:
    """Join the torchrun process group (or make a 1-rank one) on `device` (learner.device; cuda: RuntimeError with
    the reason where it cannot be used). With CUDA the group is "cpu:gloo,cuda:nccl": object collectives run on CPU."""
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"learner.device: expected auto, cuda or cpu, got {device!r}")
    cuda = device != "cpu" and torch.cuda.is_available()
    if device == "cuda" and not cuda:
        raise RuntimeError(cuda_missing())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # before any collective: nccl's object collectives use the current device
    if not dist.is_initialized():
        backend = ("cpu:gloo,cuda:nccl" if cuda else "gloo") if backend == "auto" else backend
        kw = {"device_id": device} if cuda and "nccl" in backend else {}
        if "RANK" not in os.environ:  # plain python: a group of one, with an in-memory store (no port)
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            kw |= {"store": dist.HashStore(), "rank": 0, "world_size": 1}
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=60), **kw)
    return dist.get_rank(), dist.get_world_size(), device


def close_distributed(group=None, code: int = 0) -> NoReturn:
    """End the process once every rank got here. A rank tearing gloo down while another works, or Python's
    finalization while FSDP modules hold the group's threads (pytorch#179291), can abort ("terminate called
    without an active exception"): files and servers are closed by now, so os._exit, with the exit code."""
    dist.barrier(group=group)
    dist.destroy_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


def nvidia_smi() -> tuple[int, str] | None:
    """(GPUs that nvidia-smi lists, the newest CUDA its driver supports), or None where it is absent or sees none."""
    try:
        out, gpus = (subprocess.run(["nvidia-smi", *a], capture_output=True, text=True, timeout=30).stdout for a in ([], ["-L"]))
    except (OSError, subprocess.SubprocessError):
        return None
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", out)
    return (gpus.count("GPU "), cuda.group(1) if cuda else "?") if "GPU " in gpus else None


def cuda_missing() -> str:
    """Why torch cannot use CUDA here, in one line: a CPU build, no GPU seen, or a driver older than torch's CUDA."""
    built, head = torch.version.cuda, f"learner.device=cuda but torch {torch.__version__} cannot use CUDA: "
    if built is None:
        return head + "it is a CPU build (on Linux, torch from PyPI is the CUDA build)"
    if (smi := nvidia_smi()) is None:
        return head + f"nvidia-smi finds no GPU (no driver, or none given to this container); torch is built for CUDA {built}"
    (n, supported), vers = smi, lambda v: [int(x) for x in re.findall(r"\d+", v)]
    if vers(supported) < vers(built):
        return head + (f"nvidia-smi sees {n} GPU(s) but the driver supports CUDA {supported} and torch is built for CUDA "
                       f"{built}: update the driver (CUDA 13 needs >= 580) or install a torch built for CUDA <= {supported}")
    return head + (f"nvidia-smi sees {n} GPU(s), driver CUDA {supported}, torch built for CUDA {built}; check CUDA_VISIBLE_"
                   f"DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')} and the container's --gpus")


def all_reduce(values: list, device: torch.device, op=dist.ReduceOp.SUM) -> list[float]:
    """The learner's small collectives: float64 on its device (nccl needs CUDA tensors); numbers or 0-dim tensors."""
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    dist.all_reduce(t, op=op)
    return t.tolist()


def from_rank0(obj, group=None):
    """Rank 0's `obj` on every rank (a pickled object collective, over `group`: train.py's CPU control group)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]

"""The environment block of a parity report: versions, hardware, numerics-relevant settings."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any

import torch

PACKAGES = ("mcore-zoo", "torch", "transformers", "megatron-core", "transformer-engine", "transformer_engine",
            "flash-attn", "safetensors", "numpy")  # fmt: skip

#: environment variables that change kernels or their determinism
ENV_PREFIXES = ("NVTE_", "CUBLAS_", "CUBLASLT_", "CUDNN_", "NCCL_ALGO", "TORCH_CUDNN", "TORCH_ALLOW_TF32", "VLLM_", "OMP_NUM_THREADS")


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str) -> dict[str, Any]:
    """Versions, hardware and numerics-relevant settings of this process (each engine's backend
    modules, numerics profile, knobs and fusion flags are in the report's ``runs``)."""
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        v = _version(name)
        if v:
            versions[name.replace("_", "-")] = v
    hardware: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    settings: dict[str, Any] = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
    if device == "cuda" and torch.cuda.is_available():
        hardware["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        hardware["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        hardware["cuda"] = torch.version.cuda
        hardware["cudnn"] = _cudnn_version()
        settings.update(
            matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
            cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
            bf16_reduced_precision_reduction=torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            fp16_reduced_precision_reduction=torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        )
    settings["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    return {"versions": versions, "hardware": hardware, "settings": settings}


def _cudnn_version() -> Any:
    """cuDNN's version, or why it could not be read. Asking torch loads cuDNN; on machines that also
    have a system cuDNN of another version its sub-libraries can fail to link - that must not cost
    the report (every run has finished by the time the environment is read)."""
    try:
        return torch.backends.cudnn.version()
    except Exception as exc:  # OSError / RuntimeError from the dynamic loader
        return f"unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"

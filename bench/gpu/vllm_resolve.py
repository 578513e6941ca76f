"""Resolve the wheels vLLM needs on the GPU machine by reading ``Requires-Dist``, download them.

    python3 bench/gpu/vllm_resolve.py OUT_DIR [--skip-file FILE] [--list]

Starts from ``vllm==0.26.0`` (``VLLM_VERSION``), downloads each requirement as a py3.12
manylinux x86_64 wheel with ``pip download --no-deps`` (pip's ordinary client, one package at a
time), reads the wheel's ``METADATA``, evaluates its markers for Linux x86_64 / CPython 3.12 (with
the extras that were asked for), and follows the requirements that the GPU machine does not
already have. What the machine has is ``SKIP`` below plus ``--skip-file`` (one name a line): its
image holds torch 2.11.0+cu130 with its CUDA libraries, transformers, tokenizers, safetensors,
numpy, triton and the rest of ../shared/gpu/README.md and .library/device/KINDS.md. Versions: the
newest wheel that fits every specifier seen; a conflict narrows the package or moves the package
that asked for it to an older release, and the walk starts again (``pip index versions``). A requirement
with no matching wheel on the index is left out and listed in ``OUT_DIR/missing.txt``.

Writes ``OUT_DIR/wheels.tsv`` (name, version, bytes, file, required by) and prints the total.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from collections import deque
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

VLLM = os.environ.get("VLLM_VERSION", "0.26.0")
#: the distribution the walk starts from (``RESOLVE_ROOT="sglang==0.5.17"`` for SGLang's set)
ROOT = os.environ.get("RESOLVE_ROOT", f"vllm=={VLLM}")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]  # fmt: skip

#: on the GPU machine's image already (KINDS.md pip list, ../shared/gpu/README.md), or not needed
#: by an in-process ``vllm.LLM`` (video decoding, the pinned torch stack itself)
SKIP = {
    "torch", "torchvision", "torchaudio", "triton", "transformers", "tokenizers", "safetensors", "numpy",
    "huggingface-hub", "hf-xet", "sentencepiece", "tiktoken", "pyyaml", "filelock", "typing-extensions",
    "jinja2", "markupsafe", "fsspec", "packaging", "tqdm", "regex", "requests", "urllib3", "idna", "certifi",
    "charset-normalizer", "sympy", "mpmath", "networkx", "setuptools", "pillow", "psutil", "einops", "pluggy",
    "accelerate", "jax", "jaxlib", "cupy-cuda13x", "protobuf", "six",
    # the CUDA libraries torch 2.11+cu130 brings
    "nvidia-cublas", "nvidia-cuda-runtime", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "nvidia-cuda-nvrtc",
    "nvidia-cusparse", "nvidia-cufft", "nvidia-curand", "nvidia-cusolver", "nvidia-nvjitlink", "nvidia-nvtx",
    "nvidia-cusparselt-cu13", "nvidia-cufile", "nvidia-nvshmem-cu13", "nvidia-cuda-cupti",
    # video / audio decoding: not used by text-only LLM
    "pynvvideocodec", "torchcodec",
}  # fmt: skip


def env(extra: str = "") -> dict:
    e = default_environment()
    e.update(platform_system="Linux", platform_machine="x86_64", sys_platform="linux", os_name="posix",
             python_version="3.12", python_full_version="3.12.3", implementation_name="cpython",
             platform_python_implementation="CPython", extra=extra)  # fmt: skip
    return e


def local(name: str, spec: SpecifierSet, out: Path) -> list[Path]:
    """Wheels of ``name`` already in ``out`` whose version satisfies ``spec``, newest first."""
    hits = []
    for w in out.glob("*.whl"):
        n, v, _, _ = parse_wheel_filename(w.name)
        if canonicalize_name(n) == name and spec.contains(v, prereleases=True):
            hits.append((v, w))
    return [w for _, w in sorted(hits, reverse=True)]


def download(req: Requirement, out: Path, spec: SpecifierSet | None = None) -> Path:
    spec = req.specifier if spec is None else spec
    cached = local(canonicalize_name(req.name), spec, out)
    if cached:
        return cached[0]
    spec = f"{req.name}{spec}"
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", "-d", str(out), spec]  # fmt: skip
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd += ["--platform", "any"]
    before = set(out.glob("*.whl"))
    subprocess.run(cmd, check=True)
    name = canonicalize_name(req.name)
    hits = [w for w in out.glob("*.whl") if canonicalize_name(parse_wheel_filename(w.name)[0]) == name]
    new = [w for w in hits if w not in before] or hits
    return sorted(new, key=lambda w: w.stat().st_mtime)[-1]


def requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def older_versions(name: str) -> list[str]:
    """Versions of ``name`` on the index, newest first (``pip index versions``)."""
    res = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name, "--python-version", "3.12",
                          "--only-binary=:all:"], capture_output=True, text=True)  # fmt: skip
    m = re.search(r"Available versions: (.*)", res.stdout)
    return [v.strip() for v in m.group(1).split(",")] if m else []


def resolve(out: Path, skip: set[str], extra_specs: dict[str, SpecifierSet]):  # type: ignore[no-untyped-def]
    """Breadth-first from ``ROOT``; returns ``(chosen, missing, None)`` or, when a requirement conflicts
    with a choice, ``(..., reason)`` after adding a constraint to ``extra_specs`` (then run again):
    the conflicting package is narrowed when the combined specifier has a wheel, else the package
    that asked for it is moved to an older version whose requirements fit."""
    skip = set(skip)
    queue = deque([(Requirement(ROOT), "-")])
    chosen: dict[str, tuple[Requirement, Path, str]] = {}
    done: dict[str, set[str]] = {}  # name -> extras whose requirements were followed ("" = base)
    specs: dict[str, SpecifierSet] = {}
    missing: list[str] = []
    while queue:
        req, by = queue.popleft()
        name = canonicalize_name(req.name)
        if name in skip:
            continue
        if name in chosen:
            version = parse_wheel_filename(chosen[name][1].name)[1]
            specs[name] &= req.specifier
            if version not in specs[name]:
                try:
                    download(req, out, specs[name])
                    extra_specs[name] = extra_specs.get(name, SpecifierSet()) & req.specifier
                    return chosen, missing, f"{name}: {version} -> {specs[name]} (asked by {by})"
                except subprocess.CalledProcessError:
                    pass
                requirer = canonicalize_name(re.sub(r"\[.*", "", by))
                if requirer == canonicalize_name(Requirement(ROOT).name):  # the root's own pins are fixed
                    requirer = canonicalize_name(re.sub(r"\[.*", "", chosen[name][2]))
                have = parse_wheel_filename(chosen[requirer][1].name)[1]
                for v in older_versions(requirer):
                    if Version(v) >= have or v not in specs[requirer]:
                        continue
                    wheel = download(Requirement(f"{requirer}=={v}"), out)
                    fits = all(version in Requirement(line).specifier for line in requires(wheel)
                               if canonicalize_name(Requirement(line).name) == name)  # fmt: skip
                    if fits:
                        extra_specs[requirer] = extra_specs.get(requirer, SpecifierSet()) & SpecifierSet(f"=={v}")
                        return chosen, missing, f"{requirer}: {have} -> {v} (its {name} requirement fits {version})"
                raise SystemExit(f"conflict: {name} {version} (for {chosen[name][2]}) vs {req.specifier} (for {by})")
        else:
            specs[name] = req.specifier & extra_specs.get(name, SpecifierSet())
            try:
                chosen[name] = (req, download(req, out, specs[name]), by)
            except subprocess.CalledProcessError:
                missing.append(f"{req} (for {by})")
                skip.add(name)
                continue
            done[name] = set()
        wheel = chosen[name][1]
        for extra in sorted(({""} | set(req.extras)) - done[name]):
            for line in requires(wheel):
                r = Requirement(line)
                marker = str(r.marker) if r.marker is not None else ""
                if extra == "" and (not marker or ("extra" not in marker and r.marker.evaluate(env()))):
                    queue.append((r, name))
                elif extra and "extra" in marker and r.marker.evaluate(env(extra)):
                    queue.append((r, f"{name}[{extra}]"))
            done[name].add(extra)
    return chosen, missing, None


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    skip = set(SKIP)
    if "--skip-file" in argv:
        skip |= {canonicalize_name(x) for x in Path(argv[argv.index("--skip-file") + 1]).read_text().split()}
    extra_specs: dict[str, SpecifierSet] = {}  # constraints learnt from conflicts (restarts)
    for attempt in range(12):
        chosen, missing, restart = resolve(out, skip, extra_specs)
        if restart is None:
            break
        print(f"restart {attempt + 1}: {restart}", file=sys.stderr)
    else:
        raise SystemExit("no consistent set of versions after 12 restarts")
    rows, total = [], 0
    for name, (req, wheel, by) in sorted(chosen.items()):
        size = wheel.stat().st_size
        total += size
        rows.append(f"{name}\t{parse_wheel_filename(wheel.name)[1]}\t{size}\t{wheel.name}\t{by}")
    (out / "wheels.tsv").write_text("name\tversion\tbytes\tfile\trequired_by\n" + "\n".join(rows) + "\n")
    print(f"{len(rows)} wheels, {total / 1e6:.1f} MB -> {out}/wheels.tsv")
    for m in missing:
        print("NOT ON THE INDEX (left out):", m, file=sys.stderr)
    (out / "missing.txt").write_text("".join(m + "\n" for m in missing))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

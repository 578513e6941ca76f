"""Per-tensor gaps of the zoo's gated DeltaNet layer: fla (Triton interpreter, CPU) vs torch, each vs fp64.

    PYTHONPATH=bench/cpu:FLA_TARGET:src TRITON_INTERPRET=1 python bench/cpu/gated_deltanet_fla_truth.py \
        Qwen3NextForCausalLM bfloat16
"""
import copy, dataclasses, json, os, sys, types
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
import fla_interpret as cpu_fla  # noqa
import torch
import mcore_zoo
from mcore_zoo.parallel import ensure_model_parallel
from mcore_zoo.families.gated_deltanet import kernels as K
from mcore_zoo.families.gated_deltanet import spec as S

real = K.load_fla()
K.load_fla = lambda: dataclasses.replace(real, device_types=("cpu",))
ensure_model_parallel()

# the layer in fp64 throughout (spec.py with its fp32 internals made fp64)
src = open(S.__file__).read().replace("torch.float32", "torch.float64").replace(".float()", ".double()")
S64 = types.ModuleType("spec64"); S64.__dict__["__name__"] = "spec64"
sys.modules["spec64"] = S64
exec(compile(src, "spec64", "exec"), S64.__dict__)
Cls64 = S64.gated_deltanet_class()

LENGTHS = [37, 1, 100, 5]
name, dtype = sys.argv[1], getattr(torch, sys.argv[2])
config = mcore_zoo.lookup(name).example_config()
if "num_experts" in config:
    config.update(num_experts=0)
model = mcore_zoo.build_model(config, backend="local", params_dtype=dtype, device="cpu")
layer = model.decoder.layers[0].self_attention
layer.pack = "each"
ref = copy.deepcopy(layer).double()
ref.__class__ = Cls64
ref.norm.__class__ = S64.GatedRMSNorm
ref.kernel = "torch"
names = ["output", "input_grad"] + [f"grad:{n}" for n, _ in layer.named_parameters()]

from megatron.core.packed_seq_params import PackedSeqParams
gen = torch.Generator().manual_seed(0)
bounds = torch.tensor([0] + LENGTHS).cumsum(0).to(torch.int32)
params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                         max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS))
x = torch.randn(sum(LENGTHS), 1, 64, generator=gen).to(dtype)


def run(lay, kernel, x, params):
    lay.kernel = kernel
    for p in lay.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    out, _ = lay(x, None, packed_seq_params=params)
    seed = torch.linspace(-1, 1, out.numel()).view_as(out).to(dtype).to(out.dtype)
    out.backward(seed)
    return [out.detach().double(), x.grad.double(), *(p.grad.double() for p in lay.parameters())]


result = {}
for case, xx, pp in (("thd", x, params), ("bshd", x[:64].view(32, 2, -1), None)):
    r64 = run(ref, "torch", xx.double(), pp)
    t = run(layer, "torch", xx, pp)
    f = run(layer, "fla", xx, pp)
    rows = {}
    for n, a, b, r in zip(names, f, t, r64):
        rows[n] = dict(fla_vs_torch=float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)),
                       fla_vs_64=float((a - r).abs().max() / r.abs().max().clamp_min(1e-300)),
                       torch_vs_64=float((b - r).abs().max() / r.abs().max().clamp_min(1e-300)),
                       ref_max=float(r.abs().max()))
    result[case] = rows
    print(f"== {name} {sys.argv[2]} {case}")
    print(f"{'tensor':40s} {'fla-torch':>10s} {'fla-64':>10s} {'torch-64':>10s} {'max|ref|':>10s}")
    for n, v in rows.items():
        print(f"{n:40s} {v['fla_vs_torch']:10.2e} {v['fla_vs_64']:10.2e} {v['torch_vs_64']:10.2e} {v['ref_max']:10.2e}", flush=True)
print("dots", cpu_fla.DOT_COUNT)
json.dump(result, open(f"/tmp/gated_deltanet_fla_truth-{name}-{sys.argv[2]}-tf32{os.environ.get('CPU_FLA_TF32','0')}.json", "w"), indent=1)

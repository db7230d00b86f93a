#!/usr/bin/env python3
"""torch.save files for the Rust .pt reader (crates/cachalot-convert/src/torch_pt.rs): a dict and
an OrderedDict mixing f64/f32/f16/bf16 tensors (0-dim, [N, 1], non-contiguous views, views at an
offset into a shared storage), an nn.Parameter, Python numbers, strings, lists and None, plus
expected.json with every value as the reader should return it (tensors row-major, widened to
float64).

Usage (from the repository root): /work/venv/ref/bin/python tools/quant/make_pt_fixtures.py
"""
import collections
import json
import os

import torch

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
out = os.path.join(root, "fixtures", "torch_pt")
os.makedirs(out, exist_ok=True)
g = torch.Generator().manual_seed(3)
base = torch.randn(6, 5, generator=g)
d = {
    "f32_n1": torch.rand(4, 1, generator=g),
    "f32_scalar": torch.tensor(0.875),
    "f64_n1": torch.rand(3, 1, generator=g, dtype=torch.float64),
    "f16": torch.randn(5, generator=g).half(),
    "bf16_t": torch.randn(3, 4, generator=g).to(torch.bfloat16).t(),
    "view_offset": base[2:, 1:4],
    "view_shared": base[:, 0],
    "param": torch.nn.Parameter(torch.ones(2, 2), requires_grad=False),
    "empty": torch.zeros(0, 3),
    "py_float": 0.75,
    "py_int": -70000,
    "py_big": 2 ** 40,
    "py_small": 7,
    "py_bool": True,
    "py_none": None,
    "text": "layers.0.attn.wq_a",
    "list": [1.5, 2, "x"],
}


def expect(v):
    if torch.is_tensor(v):
        return {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape),
                "values": v.detach().double().flatten().tolist()}
    return v


torch.save(d, os.path.join(out, "dict.pt"))
torch.save(collections.OrderedDict(d), os.path.join(out, "ordered.pt"))
with open(os.path.join(out, "expected.json"), "w") as f:
    json.dump({k: expect(v) for k, v in d.items()}, f, indent=1)
    f.write("\n")
print("wrote", out)

# The seed's R1 C8 scale directory (spec §5.4) for fixtures/v3/r1_tiny, holding the same scales
# as fixtures/v3/converted/c8_scales_r1_tiny.json: `convert --quant-mode w8a8c8
# --quant-param-path DIR` must give what `--c8-scales FILE` gives.
with open(os.path.join(root, "fixtures", "v3", "converted", "c8_scales_r1_tiny.json")) as f:
    scales = json.load(f)["ckv_scale"]
c8_dir = os.path.join(root, "fixtures", "v3", "c8_pth_r1_tiny")
os.makedirs(c8_dir, exist_ok=True)
for i, s in enumerate(scales):
    torch.save({"self_attn.ckv_scale": torch.tensor([s], dtype=torch.float32)},
               os.path.join(c8_dir, f"quant_parameters_{i}.pth"))
print("wrote", c8_dir, len(scales), "layers")

"""Architecture of the shipped small model and the mapping between transformers' module names and
DeepSeek-R1's checkpoint names.

The main model is transformers' own `DeepseekV3ForCausalLM`; the MTP layer is transformers' generic
`MtpModel` / `MtpLayer` (enorm, hnorm, eh_proj on [embedding; hidden], one MoE decoder block,
post_norm = R1's `shared_head.norm`, the main model's embedding and lm_head shared), i.e. spec
deepseek-v3-r1-kimi-k2.md section 3.8.
"""

import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "reference"))
import make_fixtures  # noqa: E402  (FP8 block quantizer, checkpoint writer / verifier, HF loaders)

NAME = "cachalot-tiny-r1"
ASSETS = REPO / "assets" / NAME
TRAIN_CONTEXT = 512

# config.json, with DeepSeek-R1's official field names and values wherever size does not matter
# (routing, YaRN rope_scaling, quantization_config, norms, special ids).
CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 1024,
    "kv_lora_rank": 64,
    "max_position_embeddings": 4096,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 256,
    "moe_layer_freq": 1,
    "n_group": 4,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "5.24.0",
    "use_cache": True,
    "v_head_dim": 32,
    "vocab_size": 4096,
}

# DeepSeek-R1's generation_config.json, with our transformers version.
GENERATION_CONFIG = {
    "_from_model_config": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "transformers_version": "5.24.0",
}


def build_models(c, attn="eager"):
    """Fresh (untrained) main model + MTP module, float32."""
    from transformers.modeling_layers import MtpModel
    from transformers.models.deepseek_v3 import DeepseekV3ForCausalLM

    cfg = make_fixtures.hf_config(c)
    cfg._attn_implementation = attn
    model = DeepseekV3ForCausalLM(cfg).to(torch.float32)
    mtp = MtpModel(model, c["num_nextn_predict_layers"]).to(torch.float32)
    mtp.config._attn_implementation = attn
    assert mtp.embed_tokens is model.model.embed_tokens and mtp.shared_head is model.lm_head
    return model, mtp


def init_weights(model, mtp, c, seed):
    """Explicit, seeded init of every trainable tensor (transformers' post_init leaves MtpModel's
    fused experts uninitialised): N(0, 0.02) for matrices, embeddings, router and experts, the
    residual-branch output projections scaled by 1/sqrt(2 * blocks) (GPT-2), norms 1, bias 0."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = c["num_hidden_layers"] + c["num_nextn_predict_layers"]
    std = c["initializer_range"]
    seen = set()
    for prefix, mod in (("", model), ("mtp.", mtp)):
        for name, p in sorted(mod.named_parameters(), key=lambda kv: kv[0]):
            if id(p) in seen:
                continue
            seen.add(id(p))
            with torch.no_grad():
                if p.dim() == 1:
                    p.fill_(1.0)  # RMSNorm weights
                else:
                    s = std
                    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                        s = std / (2 * n_blocks) ** 0.5
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * s)
    for mod in (model, mtp):
        for name, buf in mod.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.zero_()


def routers(model, mtp):
    """(label, DeepseekV3TopkRouter) of every MoE layer, main layers first, then the MTP block."""
    out = []
    for li, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            out.append((f"layer{li}", gate))
    for j, layer in enumerate(mtp.layers):
        out.append((f"mtp{j}", layer.mtp_block.mlp.gate))
    return out


def main_forward(model, input_ids):
    """Final-normed hidden states and logits of the main model (full recomputation, no cache)."""
    h = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
    return h, model.lm_head(h)


def mtp_forward(mtp, hidden, next_ids, pos0=0):
    """MTP rows i = 0..T-1: enorm(embed(next_ids[i])) ++ hnorm(hidden[i]) -> eh_proj -> MoE block at
    rope position pos0 + i -> shared_head.norm -> lm_head. next_ids[i] is the token at i + 1, so row i
    predicts the token at i + 2."""
    B, T = next_ids.shape
    pos = (torch.arange(T) + pos0).unsqueeze(0).expand(B, T)
    u = mtp.forward_layer(0, hidden, pos, None, input_ids=next_ids)
    return u, mtp.shared_head(u)


# ------------------------------------------------------------------------------------------------
# transformers module names -> DeepSeek-R1 checkpoint tensors
# ------------------------------------------------------------------------------------------------

# Linear layers DeepSeek ships in FP8 (per-128x128-block weight_scale_inv); everything else is bf16
# except the router bias (f32).
_FP8_SUFFIXES = (
    "self_attn.q_a_proj.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.q_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight",
    "self_attn.kv_b_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "mlp.shared_experts.gate_proj.weight",
    "mlp.shared_experts.up_proj.weight",
    "mlp.shared_experts.down_proj.weight",
)


def float_tensors_by_checkpoint_name(model, mtp, c):
    """{DeepSeek checkpoint name: f32 tensor} (no quantization yet). Fused experts are split into
    one tensor per expert (gate rows first in gate_up_proj)."""
    L, E, I = c["num_hidden_layers"], c["n_routed_experts"], c["moe_intermediate_size"]
    out = {}

    def layer(prefix_src, sd, dst):
        for k, v in sd.items():
            if not k.startswith(prefix_src):
                continue
            rest = k[len(prefix_src):]
            if rest == "mlp.experts.gate_up_proj":
                assert v.shape == (E, 2 * I, c["hidden_size"]), v.shape
                for e in range(E):
                    out[f"{dst}mlp.experts.{e}.gate_proj.weight"] = v[e, :I]
                    out[f"{dst}mlp.experts.{e}.up_proj.weight"] = v[e, I:]
            elif rest == "mlp.experts.down_proj":
                for e in range(E):
                    out[f"{dst}mlp.experts.{e}.down_proj.weight"] = v[e]
            else:
                out[dst + rest] = v

    sd = {k: v.detach().to(torch.float32).clone() for k, v in model.state_dict().items()}
    out["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"]
    for li in range(L):
        layer(f"model.layers.{li}.", sd, f"model.layers.{li}.")
    out["model.norm.weight"] = sd["model.norm.weight"]
    out["lm_head.weight"] = sd["lm_head.weight"]
    msd = {k: v.detach().to(torch.float32).clone() for k, v in mtp.state_dict().items()}
    for j in range(c["num_nextn_predict_layers"]):
        li = L + j
        dst = f"model.layers.{li}."
        layer(f"layers.{j}.mtp_block.", msd, dst)
        for a, b in (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
                     ("eh_proj.weight", "eh_proj.weight"), ("post_norm.weight", "shared_head.norm.weight")):
            out[dst + b] = msd[f"layers.{j}.{a}"]
        # DeepSeek ships copies of the (shared) embedding and head inside the MTP layer.
        out[dst + "shared_head.head.weight"] = sd["lm_head.weight"]
        out[dst + "embed_tokens.weight"] = sd["model.embed_tokens.weight"]
    return out


def is_fp8(name):
    return ".mlp.experts." in name or name.endswith(_FP8_SUFFIXES)


def quantized_builder(tensors):
    """make_fixtures.Builder holding R1-layout tensors (FP8 + scales, bf16, f32 bias) and their exact
    dequantized f32 values (`ref`)."""
    b = make_fixtures.Builder(rng=None)
    for name, w in tensors.items():
        if name.endswith("e_score_correction_bias"):
            b.f32(name, w)
        elif is_fp8(name):
            q, s, deq = make_fixtures.quantize_fp8_block(w.contiguous())
            b.ckpt[name] = q
            b.ckpt[name[: -len(".weight")] + ".weight_scale_inv"] = s
            b.ref[name] = deq
            b.fp8_names.append(name)
        else:
            b.bf16(name, w)
    # Keep DeepSeek's order: a weight's scale right after it.
    order = []
    for name in tensors:
        order.append(name)
        if name in b.fp8_names:
            order.append(name[: -len(".weight")] + ".weight_scale_inv")
    b.ckpt = {k: b.ckpt[k] for k in order}
    return b


def read_checkpoint(model_dir: Path):
    """Load an R1-layout checkpoint: returns (config, {name: raw tensor}, {name: exact f32 value})."""
    from safetensors import safe_open

    c = json.loads((model_dir / "config.json").read_text())
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    raw = {}
    for f in sorted(set(index["weight_map"].values())):
        with safe_open(str(model_dir / f), framework="pt") as fh:
            for k in fh.keys():
                raw[k] = fh.get_tensor(k)
    ref = {}
    for k, t in raw.items():
        if k.endswith("weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            ref[k] = make_fixtures.dequant_fp8_torch(t, raw[k[: -len(".weight")] + ".weight_scale_inv"])
        else:
            ref[k] = t.to(torch.float32)
    return c, raw, ref


def load_for_transformers(model_dir: Path):
    """transformers' DeepseekV3ForCausalLM + MtpModel (float32, eager) on exactly the dequantized
    checkpoint values (FP8: f32(code) * scale_inv per 128x128 block; bf16: exact)."""
    c, raw, ref = read_checkpoint(model_dir)
    model = make_fixtures.build_hf_model(c, ref)
    mtp = make_fixtures.build_hf_mtp(model, c, ref)
    L = c["num_hidden_layers"]
    for j in range(c["num_nextn_predict_layers"]):
        p = f"model.layers.{L + j}."
        assert torch.equal(raw[p + "shared_head.head.weight"], raw["lm_head.weight"])
        assert torch.equal(raw[p + "embed_tokens.weight"], raw["model.embed_tokens.weight"])
    return c, model.eval(), mtp.eval()

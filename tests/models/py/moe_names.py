"""transformers 5 keeps a mixture of experts' weights fused (mlp.experts.gate_up_proj [E, 2I, H],
mlp.experts.down_proj [E, H, I], the router as mlp.gate.weight) and converts them on load and save
to the Hub's layout: one tensor per expert and projection (Mixtral: block_sparse_moe.experts.E.w1
/ w3 / w2, block_sparse_moe.gate; Qwen3-MoE: mlp.experts.E.gate_proj / up_proj / down_proj,
mlp.gate), the names Strata uses. hub_tensors maps one of the model's named tensors to those."""
import re


def hub_tensors(model_type, name, t):
    """[(hub name, tensor)] for the model's tensor `name` (itself where nothing is fused)."""
    moe = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    proj = ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    m = re.fullmatch(r"(model\.layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj)", name)
    if m:
        p, which = m.group(1), m.group(2)
        out = []
        for e in range(t.shape[0]):
            base = f"{p}{moe}.experts.{e}."
            if which == "gate_up_proj":
                half = t.shape[1] // 2
                out += [(base + proj[0] + ".weight", t[e, :half]), (base + proj[1] + ".weight", t[e, half:])]
            else:
                out.append((base + proj[2] + ".weight", t[e]))
        return out
    m = re.fullmatch(r"(model\.layers\.\d+\.)mlp\.gate\.weight", name)
    if m:
        return [(f"{m.group(1)}{moe}.gate.weight", t)]
    return [(name, t)]


def hub_state(model):
    """The model's state_dict in the Hub's layout (contiguous fp32 copies)."""
    out = {}
    for n, t in model.state_dict().items():
        for h, x in hub_tensors(model.config.model_type, n, t):
            out[h] = x.detach().float().contiguous()
    return out

"""A local Hugging Face checkpoint (``*.safetensors``) into the engine's model.

Each checkpoint tensor maps to one destination (``Dest``): a parameter of ours (or a lightning
layer's ``slope_rate`` buffer), optionally one leading index (an expert) and a row range (a
shard of a packed matrix). The name maps (``ModelConfig.hf_architecture``):

- ``llama`` (Llama, Qwen2, Mistral): HF names, q/k/v into ``qkv_proj`` rows, gate/up into
  ``gate_up_proj`` rows;
- ``minimax`` (MiniMaxForCausalLM): the same for full-attention layers; a lightning layer's
  ``self_attn.*`` is our ``linear_attn.*``; ``block_sparse_moe.gate`` is ``mlp.gate`` and expert
  e's ``w1`` / ``w3`` / ``w2`` go to row ranges of ``mlp.experts.gate_up_proj[e]`` and to
  ``mlp.experts.down_proj[e]`` (transformers 5's fused ``mlp.experts.*`` names load as they are).
  The decay tables HF derives from the slopes (``query_decay`` ...) are checked against the
  loaded slopes, not loaded.

Refused with a ``ValueError`` naming the tensor: a tensor that maps to nothing, a shape that
differs, a destination written twice, a parameter not wholly covered at the end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from workers.config import ModelConfig
from workers.model.lightning import decay_tables

if TYPE_CHECKING:
    from workers.model.decoder import CausalLM

# HF name part -> (ours, shard) for the rows packed into one matrix.
_PACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(.+)$")
DECAY_TABLES = ("query_decay", "key_decay", "diagonal_decay")


@dataclass(frozen=True)
class Dest:
    """Where one checkpoint tensor goes: ``target[index]``, rows ``[start, start + count)``."""

    target: str
    index: int | None = None
    rows: tuple[int, int] | None = None


def hf_destination(hf_name: str, cfg: ModelConfig) -> Dest | None:
    """Our destination of the checkpoint tensor ``hf_name``; None: a tensor the engine rebuilds
    (rotary tables) or checks (MiniMax's decay tables)."""
    if "rotary_emb" in hf_name:
        return None
    if cfg.hf_architecture == "minimax":
        return _minimax(hf_name, cfg)
    return _packed(hf_name, cfg)


def _packed(hf_name: str, cfg: ModelConfig) -> Dest:
    for hf_part, (ours, shard) in _PACKED.items():
        if f".{hf_part}." in hf_name:
            sizes = _shard_rows(cfg)[ours]
            return Dest(hf_name.replace(hf_part, ours), rows=(sum(sizes[:shard]), sizes[shard]))
    return Dest(hf_name)


def _minimax(hf_name: str, cfg: ModelConfig) -> Dest | None:
    expert = _EXPERT.match(hf_name)
    if expert:
        layer, e, w = expert.group(1), int(expert.group(2)), expert.group(3)
        i = cfg.intermediate_size
        if w == "w2":
            return Dest(f"{layer}.mlp.experts.down_proj", index=e)
        return Dest(f"{layer}.mlp.experts.gate_up_proj", index=e, rows=(0, i) if w == "w1" else (i, i))
    hf_name = hf_name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
    attn = _LAYER.match(hf_name)
    if attn and cfg.layer_types and cfg.layer_types[int(attn.group(1))] == "linear_attention":
        if attn.group(2) in DECAY_TABLES:
            return None
        return Dest(f"model.layers.{attn.group(1)}.linear_attn.{attn.group(2)}")
    return _packed(hf_name, cfg)


def _shard_rows(cfg: ModelConfig) -> dict[str, list[int]]:
    return {
        "self_attn.qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
        "mlp.gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
    }


@torch.no_grad()
def load_hf_weights(model: CausalLM, path: str | Path) -> None:
    """Copy every tensor of ``path/*.safetensors`` into ``model``; raise on an unmapped or missing one."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    cfg = model.config
    targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    targets |= {n: b for n, b in model.named_buffers() if n.endswith(".slope_rate")}
    covered: dict[str, int] = {}  # elements written per target
    written: set[Dest] = set()
    tables: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                dest = hf_destination(hf_name, cfg)
                if dest is None:
                    if hf_name.rsplit(".", 1)[-1] in DECAY_TABLES:
                        tables[hf_name] = f.get_tensor(hf_name)
                    continue
                if dest.target not in targets:
                    raise ValueError(f"unexpected weight {hf_name!r} in {file.name} (no {dest.target} in the model)")
                if dest in written:
                    raise ValueError(f"{hf_name!r} in {file.name} writes {dest} a second time")
                tensor = f.get_tensor(hf_name)
                _copy(targets[dest.target], dest, tensor, hf_name)
                written.add(dest)
                covered[dest.target] = covered.get(dest.target, 0) + tensor.numel()
    _check_covered(targets, covered, cfg.tie_word_embeddings)
    _check_decay_tables(model, tables)


def _copy(dst: torch.Tensor, dest: Dest, tensor: torch.Tensor, hf_name: str) -> None:
    if dest.index is not None:
        dst = dst[dest.index]
    if dest.rows is not None:
        dst = dst.narrow(0, *dest.rows)
    if dest.target.endswith(".slope_rate"):
        tensor = tensor.reshape(-1)  # HF keeps [heads, 1, 1]
    if dst.shape != tensor.shape:
        raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
    dst.copy_(tensor.to(dst.dtype))


def _check_covered(targets: dict[str, torch.Tensor], covered: dict[str, int], tied: bool) -> None:
    """Every parameter written whole (slopes are optional: the formula's values stand in)."""
    missing = [
        f"{name} ({covered.get(name, 0)} of {t.numel()} elements)" for name, t in targets.items()
        if covered.get(name, 0) != t.numel() and not name.endswith(".slope_rate")
        and not (tied and name == "lm_head.weight")
    ]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")


def _check_decay_tables(model: CausalLM, tables: dict[str, torch.Tensor]) -> None:
    """MiniMax's saved decay tables must be the ones its loaded slopes give (HF's blocked prefill
    reads the tables, its decode the slopes: tables that disagree make a checkpoint whose prefill
    and decode compute two models)."""
    buffers = dict(model.named_buffers())
    for hf_name, saved in tables.items():
        layer, table = re.sub(r"\.self_attn\.", ".linear_attn.", hf_name).rsplit(".", 1)
        slope = buffers.get(f"{layer}.slope_rate")
        if slope is None:
            raise ValueError(f"unexpected weight {hf_name!r} (no lightning layer {layer})")
        expected = decay_tables(slope.cpu(), saved.shape[-2] if table != "diagonal_decay" else saved.shape[-1])[table]
        tol = 1e-4 if saved.dtype == torch.float32 else 5e-2
        if expected.shape != saved.shape or not torch.allclose(saved.float(), expected, rtol=tol, atol=1e-6):
            raise ValueError(f"{hf_name} disagrees with the checkpoint's slope_rate of that layer")

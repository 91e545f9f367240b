"""Per-architecture forwards built from a transformers checkpoint's weights.

The runner drives a network one layer at a time and owns attention and the cache; a network
only does the row-wise work around attention: embed, project to q/k/v, finish the layer,
produce logits. Every row-wise step is independent per row, and every matmul goes through
``layers.linear`` so the runner chooses tiled (batch-invariant) or plain multiplication.

transformers is the loader and the reference here, never the executor: no HF module's forward
is called, only its parameters are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from labkit.engine import rowwise
from labkit.engine.layers import RopeTable, Tiling, gelu_tanh, layer_norm, linear, rms_norm, rotate, silu
from labkit.engine.matmul import FixedOrder
from labkit.errors import UnknownModel
from labkit.models.loaded import LoadedModel

Tile = Tiling | FixedOrder | None  # how the invariant mode multiplies, or None for plain matmuls


@dataclass
class Shape:
    """The sizes the runner needs to lay out the KV pool and reshape attention."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int


class Network:
    """What the runner calls; subclasses hold the weights of one architecture."""

    shape: Shape
    lm_head: Tensor  # (hidden, vocab): every matmul weight is stored (in, out), see layers.linear
    # the row-wise work between the matmuls (RMSNorm after the residual add, rotary positions, the
    # MLP gate) in native passes (rowwise.py) instead of torch's many small ops; the runner turns
    # it on where the kernels build (CPU, float32), in both modes
    native_ops: bool = False

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[1]

    def embed(self, ids: Tensor, positions: Tensor) -> Tensor:
        raise NotImplementedError

    def positional(self, positions: Tensor) -> Any:
        """Whatever ``qkv`` needs about positions, computed once per forward for all layers."""
        return None

    def qkv(self, layer: int, x: Tensor, at: Any, tile: Tile) -> tuple[Tensor, Tensor, Tensor]:
        """q (rows, heads, d), k and v (rows, kv_heads, d), positions already applied."""
        raise NotImplementedError

    def finish(self, layer: int, x: Tensor, attn: Tensor, tile: Tile) -> Tensor:
        """The rest of the layer after attention: output projection, residuals, MLP."""
        raise NotImplementedError

    def logits(self, x: Tensor, tile: Tile) -> Tensor:
        raise NotImplementedError

    def matmuls(self) -> list[tuple[Tensor, Tensor | None]]:
        """(weight, bias) of every matrix product one forward makes, in order, lm head last:
        what the benchmark times alone as the step's floor."""
        raise NotImplementedError


def build_network(loaded: LoadedModel, dtype: torch.dtype, device: torch.device) -> Network:
    """The network for ``loaded.arch`` with its weights in ``dtype`` on ``device``.

    Matmul weights are stored (in, out). GPT-2's Conv1D weights already are, and are shared
    with the HF model when already in that dtype and place; Linear weights (out, in), fused ones
    (q/k/v, gate/up) and the lm head are transposed into new tensors.
    """
    if loaded.arch == "gpt2":
        return GPT2Network(loaded.model, dtype, device)
    if loaded.arch == "llama":
        return LlamaNetwork(loaded.model, dtype, device)
    raise UnknownModel(f"the runner has no forward for architecture {loaded.arch!r}")


#: One layer's parameters by name: weights are tensors, a bias may be None (Llama has none).
Block = dict[str, Any]


def _param(t: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """``t`` (a weight, or a bias that may be None) detached, cast and contiguous on ``device``."""
    return None if t is None else t.detach().to(device=device, dtype=dtype).contiguous()


# ---------------------------------------------------------------------------------------------
class GPT2Network(Network):
    """GPT-2: learned positions, pre-LayerNorm blocks, gelu_new MLP, lm head tied to wte.

    transformers stores GPT-2's projections as Conv1D, weight (in, out): the layout ``linear``
    takes, so they are used as they are.
    """

    def __init__(self, model, dtype: torch.dtype, device: torch.device) -> None:
        cfg = model.config
        act = cfg.activation_function
        _require(act in ("gelu_new", "gelu_pytorch_tanh"), "activation_function", act)
        _require(cfg.scale_attn_weights and not cfg.scale_attn_by_inverse_layer_idx, "attention scaling", "custom")
        self.shape = Shape(cfg.n_layer, cfg.n_head, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.n_positions)
        self.eps = cfg.layer_norm_epsilon
        p = lambda t: _param(t, dtype, device)  # noqa: E731
        body = model.transformer
        self.wte, self.wpe = p(body.wte.weight), p(body.wpe.weight)
        self.ln_f: tuple[Tensor, Tensor] = (p(body.ln_f.weight), p(body.ln_f.bias))
        self.lm_head = p(model.lm_head.weight.t())
        self.blocks = [self._block(b, p) for b in body.h]

    @staticmethod
    def _block(b, p) -> Block:
        return {
            "ln_1_w": p(b.ln_1.weight),
            "ln_1_b": p(b.ln_1.bias),
            "qkv_w": p(b.attn.c_attn.weight),
            "qkv_b": p(b.attn.c_attn.bias),
            "out_w": p(b.attn.c_proj.weight),
            "out_b": p(b.attn.c_proj.bias),
            "ln_2_w": p(b.ln_2.weight),
            "ln_2_b": p(b.ln_2.bias),
            "fc_w": p(b.mlp.c_fc.weight),
            "fc_b": p(b.mlp.c_fc.bias),
            "proj_w": p(b.mlp.c_proj.weight),
            "proj_b": p(b.mlp.c_proj.bias),
        }

    def embed(self, ids: Tensor, positions: Tensor) -> Tensor:
        return self.wte[ids] + self.wpe[positions]

    def qkv(self, layer: int, x: Tensor, at: Any, tile: Tile) -> tuple[Tensor, Tensor, Tensor]:
        w = self.blocks[layer]
        h = layer_norm(x, w["ln_1_w"], w["ln_1_b"], self.eps)
        q, k, v = linear(h, w["qkv_w"], w["qkv_b"], tile).view(x.shape[0], 3, self.shape.num_heads, -1).unbind(1)
        return q, k, v

    def finish(self, layer: int, x: Tensor, attn: Tensor, tile: Tile) -> Tensor:
        w = self.blocks[layer]
        x = x + linear(attn, w["out_w"], w["out_b"], tile)
        h = layer_norm(x, w["ln_2_w"], w["ln_2_b"], self.eps)
        h = gelu_tanh(linear(h, w["fc_w"], w["fc_b"], tile))
        return x + linear(h, w["proj_w"], w["proj_b"], tile)

    def logits(self, x: Tensor, tile: Tile) -> Tensor:
        return linear(layer_norm(x, *self.ln_f, self.eps), self.lm_head, None, tile)

    def matmuls(self) -> list[tuple[Tensor, Tensor | None]]:
        names = ("qkv", "out", "fc", "proj")
        return [(w[f"{n}_w"], w[f"{n}_b"]) for w in self.blocks for n in names] + [(self.lm_head, None)]


# ---------------------------------------------------------------------------------------------
_STATIC_ROPE = ("default", "linear", "llama3")


class LlamaNetwork(Network):
    """Llama family: RMSNorm, RoPE, grouped-query attention, SiLU-gated MLP, tied or untied head.

    q/k/v are fused into one weight and gate/up into another, so a layer is four matmuls.
    """

    def __init__(self, model, dtype: torch.dtype, device: torch.device) -> None:
        cfg = model.config
        rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        _require(rope_type in _STATIC_ROPE, "rope_type", rope_type)
        _require(cfg.hidden_act == "silu", "hidden_act", cfg.hidden_act)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.shape = Shape(
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            head_dim,
            cfg.max_position_embeddings,
        )
        self.eps = cfg.rms_norm_eps
        p = lambda t: _param(t, dtype, device)  # noqa: E731
        body = model.model
        rotary = body.rotary_emb
        self.rope = RopeTable(rotary.inv_freq, float(rotary.attention_scaling), self.shape.max_positions, dtype, device)
        self.embed_tokens, self.norm = p(body.embed_tokens.weight), p(body.norm.weight)
        self.lm_head = p(model.lm_head.weight.t())
        self.blocks = [self._block(b, p) for b in body.layers]

    @staticmethod
    def _block(b, p) -> Block:
        a, m = b.self_attn, b.mlp
        return {
            "norm_in": p(b.input_layernorm.weight),
            "norm_post": p(b.post_attention_layernorm.weight),
            "qkv_w": p(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).t()),
            "qkv_b": _cat_bias(p, a.q_proj, a.k_proj, a.v_proj),
            "o_w": p(a.o_proj.weight.t()),
            "o_b": p(a.o_proj.bias),
            "gate_up_w": p(torch.cat([m.gate_proj.weight, m.up_proj.weight]).t()),
            "gate_up_b": _cat_bias(p, m.gate_proj, m.up_proj),
            "down_w": p(m.down_proj.weight.t()),
            "down_b": p(m.down_proj.bias),
        }

    def embed(self, ids: Tensor, positions: Tensor) -> Tensor:
        return self.embed_tokens[ids]

    def positional(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.rope.lookup(positions)

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        return rowwise.rms_norm(x, weight, self.eps) if self.native_ops else rms_norm(x, weight, self.eps)

    def qkv(self, layer: int, x: Tensor, at: tuple[Tensor, Tensor], tile: Tile) -> tuple[Tensor, Tensor, Tensor]:
        w, s = self.blocks[layer], self.shape
        h = self._norm(x, w["norm_in"])
        fused = linear(h, w["qkv_w"], w["qkv_b"], tile).view(x.shape[0], s.num_heads + 2 * s.num_kv_heads, s.head_dim)
        if self.native_ops:  # q and k heads rotated together, in place
            qk = rowwise.rope(fused[:, : s.num_heads + s.num_kv_heads], *at)
        else:
            qk = rotate(fused[:, : s.num_heads + s.num_kv_heads], *at)
        return qk[:, : s.num_heads], qk[:, s.num_heads :], fused[:, s.num_heads + s.num_kv_heads :]

    def finish(self, layer: int, x: Tensor, attn: Tensor, tile: Tile) -> Tensor:
        w = self.blocks[layer]
        # linear() returns a new tensor, so the residual adds go into it in place (a + b == b + a
        # bitwise): a layer allocates its outputs and nothing else
        if self.native_ops:  # the residual add and the norm in one pass
            out = linear(attn, w["o_w"], w["o_b"], tile)
            h = rowwise.rms_norm(out, w["norm_post"], self.eps, residual=x)
            x = out
        else:
            x = linear(attn, w["o_w"], w["o_b"], tile).add_(x)
            h = rms_norm(x, w["norm_post"], self.eps)
        gate_up = linear(h, w["gate_up_w"], w["gate_up_b"], tile)
        if self.native_ops:
            gated = rowwise.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            gated = silu(gate).mul_(up)
        return linear(gated, w["down_w"], w["down_b"], tile).add_(x)

    def logits(self, x: Tensor, tile: Tile) -> Tensor:
        return linear(self._norm(x, self.norm), self.lm_head, None, tile)

    def matmuls(self) -> list[tuple[Tensor, Tensor | None]]:
        names = ("qkv", "o", "gate_up", "down")
        return [(w[f"{n}_w"], w[f"{n}_b"]) for w in self.blocks for n in names] + [(self.lm_head, None)]


def _cat_bias(p, *projections) -> Tensor | None:
    """The fused projection's bias, or None when none of its parts has one."""
    if all(proj.bias is None for proj in projections):
        return None
    parts = [proj.bias if proj.bias is not None else proj.weight.new_zeros(proj.out_features) for proj in projections]
    return p(torch.cat(parts))


def _require(ok: bool, field: str, value: object) -> None:
    if not ok:
        raise UnknownModel(f"the paged runner does not support {field}={value!r}")

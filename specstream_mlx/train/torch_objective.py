"""The training objective of :mod:`.objective`, in PyTorch, on a ``transformers`` model.

The same two passes and the same losses as the MLX objective, term by term:
the main pass runs every layer causally and records the MSA layers' keys and
values; the stream pass runs stream rows ``M[t] + P[j]`` through the top
layers at positions ``t + j`` under the same mask. The decoder block is
written here over the Hugging Face modules' own weights, norms and rotary
embedding (rather than calling the HF layer) because the stream pass needs
what the HF layer does not take: an explicit per-row position, a cached
prefix plus a custom boolean mask, and LoRA deltas on chosen projections.

Gradients are taken segment by segment (:func:`backward_segments`): the main
pass runs once, each segment of stream positions is a separate graph whose
backward pass frees it before the next begins, so memory is bounded by one
segment; in shared mode the gradients reaching the main pass's outputs are
accumulated and sent through the main pass in one final backward call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


class TorchLoRA(nn.Module):
    """``scale * (x @ a) @ b``: the same parameters and names as the MLX LoRA."""

    def __init__(self, a: np.ndarray, b: np.ndarray, scale: float):
        super().__init__()
        self.a = nn.Parameter(torch.from_numpy(np.array(a, dtype=np.float32)))
        self.b = nn.Parameter(torch.from_numpy(np.array(b, dtype=np.float32)))
        self.scale = float(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * ((x @ self.a) @ self.b)


class TorchTrainable(nn.Module):
    """Every trained parameter, keyed like the MLX ``Trainable``'s flattened tree
    (``streams.embeddings``, ``streams.lora.layer4.q_proj.a``, ``base_lora...``),
    so weights convert back and forth by name."""

    def __init__(self, flat: Dict[str, np.ndarray], lora_scale: float):
        super().__init__()
        self.names = sorted(flat)
        self.lora_scale = lora_scale
        self.params = nn.ParameterDict(
            {_key(k): nn.Parameter(torch.from_numpy(np.array(v, dtype=np.float32))) for k, v in flat.items()}
        )

    def get(self, name: str) -> Optional[torch.Tensor]:
        return self.params[_key(name)] if _key(name) in self.params else None

    def loras(self, prefix: str, layer: int) -> Dict[str, tuple]:
        """{projection: (a, b)} under ``prefix`` (``streams.lora`` or ``base_lora``) for one layer."""
        head = f"{prefix}.layer{layer}."
        out = {}
        for name in self.names:
            if name.startswith(head) and name.endswith(".a"):
                proj = name[len(head) : -2]
                out[proj] = (self.get(name), self.get(f"{head}{proj}.b"))
        return out

    def to_numpy(self) -> Dict[str, np.ndarray]:
        return {n: self.get(n).detach().cpu().numpy() for n in self.names}


def _key(name: str) -> str:
    return name.replace(".", "__")  # ParameterDict keys cannot contain dots


def check_architecture(hf_model) -> None:
    mt = hf_model.config.model_type
    if mt not in SUPPORTED:
        raise ValueError(f"the torch backend supports {', '.join(SUPPORTED)}; this model is {mt!r}")
    if getattr(hf_model.config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise ValueError("the torch backend does not support partial rotary embeddings")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _proj(module: nn.Linear, name: str, x: torch.Tensor, loras: Dict[str, tuple], scale: float) -> torch.Tensor:
    y = module(x)
    ab = loras.get(name)
    if ab is not None:
        y = y + scale * ((x @ ab[0]) @ ab[1])
    return y


@dataclass
class KV:
    keys: torch.Tensor  # (B, kv_heads, L, head_dim), after RoPE
    values: torch.Tensor


def block(layer, x, mask, cos_sin, prefix: Optional[KV], loras: Dict[str, tuple], scale: float):
    """One decoder layer over rows ``x`` (B, R, h); keys are ``[prefix | own rows]``.

    Returns (new x, this call's own KV)."""
    attn, B, R = layer.self_attn, x.shape[0], x.shape[1]
    hd = attn.head_dim
    h = layer.input_layernorm(x)
    q = _proj(attn.q_proj, "q_proj", h, loras, scale).view(B, R, -1, hd)
    k = _proj(attn.k_proj, "k_proj", h, loras, scale).view(B, R, -1, hd)
    v = _proj(attn.v_proj, "v_proj", h, loras, scale).view(B, R, -1, hd)
    if hasattr(attn, "q_norm"):  # qwen3: RMSNorm per head before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = (t.unsqueeze(1) for t in cos_sin)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    own = KV(k, v)
    if prefix is not None:
        k, v = torch.cat([prefix.keys, k], dim=2), torch.cat([prefix.values, v], dim=2)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
    o = o.transpose(1, 2).reshape(B, R, -1)
    x = x + _proj(attn.o_proj, "o_proj", o, loras, scale)
    h = layer.post_attention_layernorm(x)
    mlp = layer.mlp
    g = _proj(mlp.gate_proj, "gate_proj", h, loras, scale)
    u = _proj(mlp.up_proj, "up_proj", h, loras, scale)
    x = x + _proj(mlp.down_proj, "down_proj", mlp.act_fn(g) * u, loras, scale)
    return x, own


def lm_logits(hf_model, h: torch.Tensor) -> torch.Tensor:
    return hf_model.lm_head(hf_model.model.norm(h))


def frozen_head_logits(hf_model, h: torch.Tensor) -> torch.Tensor:
    """Final norm and LM head with their weights detached (the pruning loss must not move them)."""
    norm = hf_model.model.norm
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm.weight.detach()
    return h @ hf_model.lm_head.weight.detach().T


@dataclass
class MainPass:
    h_s0: torch.Tensor  # (B, L, h): input of the stream-insertion layer
    kv: List[KV]  # per MSA layer
    h_final: torch.Tensor

    def tensors(self) -> List[torch.Tensor]:
        return [self.h_s0] + [t for kv in self.kv for t in (kv.keys, kv.values)]

    @staticmethod
    def from_tensors(ts: List[torch.Tensor], h_final) -> "MainPass":
        kv = [KV(ts[i], ts[i + 1]) for i in range(1, len(ts), 2)]
        return MainPass(ts[0], kv, h_final)


def main_pass(hf_model, trainable: TorchTrainable, tokens: torch.Tensor, s0: int) -> MainPass:
    B, L = tokens.shape
    dev = tokens.device
    pos = torch.arange(L, device=dev).unsqueeze(0).expand(B, L)
    h = hf_model.model.embed_tokens(tokens)
    cos_sin = hf_model.model.rotary_emb(h, pos)
    mask = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    kvs, h_s0 = [], None
    for i, layer in enumerate(hf_model.model.layers):
        if i == s0:
            h_s0 = h
        h, kv = block(layer, h, mask, cos_sin, None, trainable.loras("base_lora", i), trainable.lora_scale)
        if i >= s0:
            kvs.append(kv)
    return MainPass(h_s0, kvs, h)


def stream_block_mask(n_pos: int, gamma: int, device=None) -> torch.Tensor:
    """(R, R), R = n_pos·γ: stream (t, j) sees streams (t, 1..j) of its own position."""
    own = torch.ones(gamma, gamma, dtype=torch.bool, device=device).tril()
    return torch.kron(torch.eye(n_pos, dtype=torch.int32, device=device), own.int()).bool()


def stream_pass(hf_model, trainable: TorchTrainable, main: MainPass, spos: torch.Tensor, gamma: int, s0: int, lossless):
    """Stream hidden states (B, S, γ, h) for stream positions ``spos`` (B, S)."""
    B, S = spos.shape
    L, dev = main.h_s0.shape[1], spos.device
    emb = trainable.get("streams.embeddings")
    M = torch.gather(main.h_s0, 1, spos[..., None].expand(B, S, main.h_s0.shape[-1]))
    x = (M[:, :, None, :] + emb[None, None]).reshape(B, S * gamma, -1)
    js = torch.arange(1, gamma + 1, device=dev)
    positions = (spos[:, :, None] + js).reshape(B, S * gamma)
    host = spos.repeat_interleave(gamma, dim=1)
    main_part = torch.arange(L, device=dev)[None, None, :] <= host[:, :, None]
    own = stream_block_mask(S, gamma, dev)[None].expand(B, -1, -1)
    mask = torch.cat([main_part, own], dim=-1)[:, None]
    cos_sin = hf_model.model.rotary_emb(x, positions)
    prefix = "streams.lora" if lossless else "base_lora"
    for i in range(s0, len(hf_model.model.layers)):
        layer = hf_model.model.layers[i]
        x, _ = block(layer, x, mask, cos_sin, main.kv[i - s0], trainable.loras(prefix, i), trainable.lora_scale)
    return x.reshape(B, S, gamma, -1)


def _masked_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none").view(targets.shape)


def stream_counts(spos, sweight, lengths, gamma: int) -> torch.Tensor:
    """(γ,) number of valid (position, stream) targets: the loss normaliser of every segment."""
    js = torch.arange(1, gamma + 1, device=spos.device)
    valid = ((spos[..., None] + 1 + js) < lengths[:, None, None]).float() * sweight[..., None]
    return valid.sum(dim=(0, 1))


def segment_loss(hf_model, trainable, cfg, main: MainPass, tokens, spos, sweight, lengths, n: torch.Tensor, s0):
    """This segment's share of the stream loss (normalised by the whole batch's ``n``) and its sums."""
    gamma = trainable.get("streams.embeddings").shape[0]
    lossless = cfg.mode == "lossless"
    B, L = tokens.shape
    js = torch.arange(1, gamma + 1, device=tokens.device)
    hs = stream_pass(hf_model, trainable, main, spos, gamma, s0, lossless)
    logits = lm_logits(hf_model, hs)  # (B, seg, γ, V)
    tgt_pos = spos[..., None] + 1 + js
    valid = (tgt_pos < lengths[:, None, None]).float() * sweight[..., None]
    seg = spos.shape[1]
    tgt = torch.gather(tokens, 1, tgt_pos.clamp(0, L - 1).reshape(B, -1)).view(B, seg, gamma)
    ce = (_masked_ce(logits, tgt) * valid).sum(dim=(0, 1))
    acc = ((logits.argmax(-1) == tgt).float() * valid).sum(dim=(0, 1))
    loss = ce / n
    kl = torch.zeros(gamma, device=tokens.device)
    if lossless and cfg.distill:
        teach_pos = (spos[..., None] + js).clamp(0, L - 1).reshape(B, -1)
        th = torch.gather(main.h_final, 1, teach_pos[..., None].expand(-1, -1, main.h_final.shape[-1]))
        t_logp = F.log_softmax(lm_logits(hf_model, th.view(B, seg, gamma, -1)).detach(), dim=-1)
        s_logp = F.log_softmax(logits, dim=-1)
        kl = ((t_logp.exp() * (t_logp - s_logp)).sum(-1) * valid).sum(dim=(0, 1))
        loss = loss + cfg.distill_weight * kl / n
    return cfg.alpha_stream * loss.sum(), ce.detach(), acc.detach(), kl.detach()


def backward_segments(hf_model, trainable: TorchTrainable, cfg, batch: Dict[str, torch.Tensor], s0: int, train=True):
    """Compute the loss of one batch and accumulate its gradients, one segment at a time.

    Returns the metrics (loss, stream_ce, stream_acc, ... as floats/lists), like the MLX
    objective. ``train=False``: the metrics only (validation), no graph is built."""
    with torch.set_grad_enabled(train):
        return _backward_segments(hf_model, trainable, cfg, batch, s0, train)


def _backward_segments(hf_model, trainable: TorchTrainable, cfg, batch: Dict[str, torch.Tensor], s0: int, train):
    tokens, loss_mask, spos, sweight, lengths = (
        batch[k] for k in ("tokens", "loss_mask", "spos", "sweight", "lengths")
    )
    lossless = cfg.mode == "lossless"
    gamma = trainable.get("streams.embeddings").shape[0] if cfg.streams else 0
    metrics: dict = {}
    if lossless:
        with torch.no_grad():
            main = main_pass(hf_model, trainable, tokens, s0)
        leaves = main
    else:
        main = main_pass(hf_model, trainable, tokens, s0)
        leaves = MainPass.from_tensors(
            [t.detach().requires_grad_(train) for t in main.tensors()], main.h_final.detach()
        )
    lm = loss_mask[:, :-1]
    n_main = lm.sum().clamp(min=1.0)
    dev = tokens.device
    main_term = torch.zeros((), device=dev)
    if not lossless:
        logits = lm_logits(hf_model, main.h_final[:, :-1])
        main_ce = (_masked_ce(logits, tokens[:, 1:]) * lm).sum() / n_main
        main_term = cfg.alpha_main * main_ce
        metrics["main_ce"] = float(main_ce.detach())
        metrics["main_acc"] = float(((logits.detach().argmax(-1) == tokens[:, 1:]).float() * lm).sum() / n_main)
    total = float(main_term.detach())
    if cfg.streams:
        n = stream_counts(spos, sweight, lengths, gamma).clamp(min=1.0)
        sums = [torch.zeros(gamma, device=dev) for _ in range(3)]
        for s in range(0, spos.shape[1], cfg.segment):
            sl = slice(s, s + cfg.segment)
            loss, *parts = segment_loss(
                hf_model, trainable, cfg, leaves, tokens, spos[:, sl], sweight[:, sl], lengths, n, s0
            )
            if train:
                loss.backward()  # frees this segment's graph; gradients accumulate
            total += float(loss.detach())
            sums = [a + b for a, b in zip(sums, parts)]
        metrics["stream_ce"] = (sums[0] / n).cpu().tolist()
        metrics["stream_acc"] = (sums[1] / n).cpu().tolist()
        if lossless and cfg.distill:
            metrics["stream_kl"] = (sums[2] / n).cpu().tolist()
        # Pruning adapter: early-exit next-token prediction at the insertion layer.
        down, up = trainable.get("streams.pruning.down"), trainable.get("streams.pruning.up")
        h = main.h_s0[:, :-1].detach()
        ee = frozen_head_logits(hf_model, h + (h @ down) @ up)
        prune_ce = (_masked_ce(ee, tokens[:, 1:]) * lm).sum() / n_main
        if train:
            (cfg.alpha_stream * prune_ce).backward()
        total += float(cfg.alpha_stream * prune_ce.detach())
        metrics["prune_ce"] = float(prune_ce.detach())
    if train and not lossless:
        # The gradients reaching the main pass's outputs, sent through it once.
        outs = [main_term] + main.tensors()
        grads = [torch.ones((), device=dev)] + [
            t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves.tensors()
        ]
        if any(o.requires_grad for o in outs):
            torch.autograd.backward(
                [o for o in outs if o.requires_grad], [g for o, g in zip(outs, grads) if o.requires_grad]
            )
    metrics["loss"] = total
    return metrics


def teacher_forced_stream_logits(hf_model, trainable: TorchTrainable, tokens: torch.Tensor, s0: int, lossless=True):
    """(B, L, γ, V) stream logits at every position of ``tokens``: the parity oracle's torch side."""
    with torch.no_grad():
        main = main_pass(hf_model, trainable, tokens, s0)
        gamma = trainable.get("streams.embeddings").shape[0]
        spos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand(tokens.shape[0], -1)
        return lm_logits(hf_model, stream_pass(hf_model, trainable, main, spos, gamma, s0, lossless))


def lr_lambda(total: int, warmup: int):
    """Linear warm-up then linear decay to 0: the MLX schedule, as a multiplier."""

    def f(step: int) -> float:
        if warmup and step < warmup:
            return max(step / warmup, 1e-8)
        return max(0.0, 1.0 - (step - warmup) / max(total, 1))

    return f


def calibration_positions(hf_model, trainable: TorchTrainable, tokens: torch.Tensor, s0: int):
    """Early-exit probabilities of the main stream's top-4 choices at every position
    (B, L, 4): the torch side of :mod:`.calibrate`."""
    with torch.no_grad():
        main = main_pass(hf_model, trainable, tokens, s0)
        logits = lm_logits(hf_model, main.h_final)
        down, up = trainable.get("streams.pruning.down"), trainable.get("streams.pruning.up")
        h = main.h_s0
        p_ee = torch.softmax(lm_logits(hf_model, h + (h @ down) @ up).float(), dim=-1)
        order = logits.argsort(dim=-1, descending=True)[..., :4]
        return torch.gather(p_ee, -1, order)

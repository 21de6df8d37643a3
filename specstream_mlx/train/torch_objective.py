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

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


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


def layer_window(hf_model, layer) -> Optional[int]:
    """The sliding window a layer attends within (gemma3's local layers, every mistral
    layer when its config sets one); None for global attention."""
    if hf_model.config.model_type == "mistral":
        return getattr(hf_model.config, "sliding_window", None)
    if hf_model.config.model_type != "gemma3_text":
        return None
    return getattr(layer.self_attn, "sliding_window", None)


def rotations(hf_model, x: torch.Tensor, positions: torch.Tensor) -> List[tuple]:
    """(cos, sin) of every layer at ``positions`` (B, R): one per RoPE kind, computed once."""
    layers = hf_model.model.layers
    if hf_model.config.model_type != "gemma3_text":
        return [hf_model.model.rotary_emb(x, positions)] * len(layers)
    kinds = hf_model.config.layer_types
    by_kind = {k: hf_model.model.rotary_emb(x, positions, k) for k in set(kinds)}
    return [by_kind[k] for k in kinds]


def windowed(mask: Optional[torch.Tensor], qpos: torch.Tensor, kpos: torch.Tensor, window: Optional[int]):
    """``mask`` (None: causal) limited to keys less than ``window`` positions behind each
    query; ``qpos`` (B, R), ``kpos`` (B, K). The rule of the MLX models' ``window_mask``."""
    if window is None:
        return mask
    dist = qpos[:, None, :, None] - kpos[:, None, None, :]
    near = dist < window
    return near & (dist >= 0) if mask is None else mask & near


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
    # mask None: causal (the main pass), which lets SDPA take its fused kernel.
    gqa = q.shape[1] != k.shape[1]
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=attn.scaling, enable_gqa=gqa
    )
    o = o.transpose(1, 2).reshape(B, R, -1)
    a = _proj(attn.o_proj, "o_proj", o, loras, scale)
    gemma = hasattr(layer, "pre_feedforward_layernorm")  # gemma3: outputs normed before each residual
    if gemma:
        x = x + layer.post_attention_layernorm(a)
        h = layer.pre_feedforward_layernorm(x)
    else:
        x = x + a
        h = layer.post_attention_layernorm(x)
    mlp = layer.mlp
    g = _proj(mlp.gate_proj, "gate_proj", h, loras, scale)
    u = _proj(mlp.up_proj, "up_proj", h, loras, scale)
    m = _proj(mlp.down_proj, "down_proj", mlp.act_fn(g) * u, loras, scale)
    x = x + (layer.post_feedforward_layernorm(m) if gemma else m)
    return x, own


def lm_logits(hf_model, h: torch.Tensor) -> torch.Tensor:
    return hf_model.lm_head(hf_model.model.norm(h))


def frozen_norm(hf_model, h: torch.Tensor) -> torch.Tensor:
    """The final norm with its weight detached (the pruning loss must not move it)."""
    norm = hf_model.model.norm
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    if hf_model.config.model_type == "gemma3_text":  # zero-centred weight, in float32
        hf = h.float()
        scale = 1.0 + norm.weight.detach().float()
        return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(h.dtype)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm.weight.detach()


class HeadLoss(torch.autograd.Function):
    """Cross-entropy (and KL to a teacher) of ``rows @ weight.T``, computed in row chunks.

    The vocabulary-wide tensors of a loss (logits, probabilities, their gradient)
    exist for ``chunk`` rows at a time, never for all rows: at a 49k vocabulary a
    (rows × V) float32 tensor is 200 KB per row, and a segment has hundreds of rows.
    The gradient is taken in the forward pass, where the chunk's softmax is at
    hand: d/dlogits of ``w_ce·CE + w_kl·KL(q‖p)`` is ``(w_ce + w_kl)·p − w_ce·onehot
    − w_kl·q``; what is kept for the backward pass is (rows × h), not (rows × V).
    Few passes over each (rows × V) chunk: they, not the matmuls, bound a bfloat16 step.

    Inputs: ``x`` (N, h) normalised hidden rows, ``weight`` (V, h), ``targets`` (N,),
    ``w_ce``/``w_kl`` (N,) per-row loss weights (0 for padding), ``teacher`` a
    :class:`Teacher` or None with ``teacher_idx`` (N,) its row for each. Returns the
    weighted loss (scalar) and, per row, CE, KL and whether the argmax is the target
    (detached metrics)."""

    @staticmethod
    def forward(ctx, x, weight, targets, w_ce, w_kl, teacher, teacher_idx, chunk):
        n = x.shape[0]
        f32 = dict(dtype=torch.float32, device=x.device)
        loss = torch.zeros((), **f32)
        ce, kl, hit = torch.zeros(n, **f32), torch.zeros(n, **f32), torch.zeros(n, **f32)
        gx = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        gw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        with torch.no_grad():
            for s in range(0, n, chunk):
                sl = slice(s, min(s + chunk, n))
                t = targets[sl][:, None]
                # The matmuls run in the weight's precision; the softmax in float32.
                z = (x[sl].to(weight.dtype) @ weight.T).float()
                top, arg = z.max(-1)
                z.sub_(top[:, None])  # z: logits - max
                p = z.exp()
                total = p.sum(-1)
                p.div_(total[:, None])
                lse = total.log()  # log-sum-exp of z
                ce[sl] = lse - z.gather(-1, t)[:, 0]
                hit[sl] = (arg == t[:, 0]).float()
                rows = None if teacher is None else teacher_idx[sl]
                # A top-k teacher keeps mass m = Σ_K q < 1: the KL over it, Σ_K q (log q − log p),
                # has gradient m·p − q (on K) in the logits; the full teacher has m = 1.
                mass = None if teacher is None or teacher.ids is None else teacher.mass[rows]
                wk = w_kl[sl] if mass is None else w_kl[sl] * mass
                g = p.mul_((w_ce[sl] + wk)[:, None])
                g.scatter_add_(-1, t, -w_ce[sl][:, None])
                if teacher is not None:
                    q = teacher.probs[rows]
                    if teacher.ids is None:
                        # KL(q‖p) = Σ q log q − Σ q z + lse (Σ q = 1)
                        kl[sl] = teacher.neg_entropy[rows] - (q * z).sum(-1) + lse
                        g.sub_(q.mul_(w_kl[sl][:, None]))
                    else:
                        ids = teacher.ids[rows]
                        kl[sl] = teacher.neg_entropy[rows] - (q * z.gather(-1, ids)).sum(-1) + mass * lse
                        g.scatter_add_(-1, ids, -q * w_kl[sl][:, None])
                loss += (w_ce[sl] * ce[sl] + w_kl[sl] * kl[sl]).sum()
                g = g.to(weight.dtype)
                if gx is not None:
                    gx[sl] = (g @ weight).to(x.dtype)
                if gw is not None:
                    gw += g.T @ x[sl].to(weight.dtype)
        ctx.save_for_backward(gx, gw)
        ctx.mark_non_differentiable(ce, kl, hit)
        return loss, ce, kl, hit

    @staticmethod
    def backward(ctx, grad_loss, *_):
        gx, gw = ctx.saved_tensors
        return (
            None if gx is None else grad_loss * gx,
            None if gw is None else grad_loss * gw,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def head_loss(x, weight, targets, w_ce, w_kl=None, teacher=None, teacher_idx=None, chunk: int = 64):
    """:class:`HeadLoss` on any leading shape: ``x`` (..., h), the rest (...)."""
    shape = targets.shape
    flat = lambda t: None if t is None else t.reshape(-1)  # noqa: E731
    w_kl = torch.zeros_like(w_ce) if w_kl is None else w_kl
    loss, ce, kl, hit = HeadLoss.apply(
        x.reshape(-1, x.shape[-1]), weight, flat(targets), flat(w_ce), flat(w_kl), teacher, flat(teacher_idx), chunk
    )
    return loss, ce.view(shape), kl.view(shape), hit.view(shape)


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
    return main_layers(hf_model, trainable, hf_model.model.embed_tokens(tokens), 0, s0)


def main_from_features(hf_model, h_s0: torch.Tensor, s0: int) -> MainPass:
    """The main pass of a lossless run from its cached input to the first stream layer:
    only the top layers run (the frozen base below them gives the same ``h_s0`` every
    epoch), recording their keys and values as :func:`main_pass` does."""
    return main_layers(hf_model, TorchTrainable({}, 1.0), h_s0, s0, s0)


def main_layers(hf_model, trainable: TorchTrainable, h: torch.Tensor, first: int, s0: int) -> MainPass:
    """The main rows ``h`` (B, L, hidden) entering layer ``first`` through every layer
    from there, causally, recording the keys and values of the layers from ``s0``."""
    B, L = h.shape[:2]
    pos = torch.arange(L, device=h.device).unsqueeze(0).expand(B, L)
    cos_sin = rotations(hf_model, h, pos)
    kvs, h_s0 = [], None
    for i in range(first, len(hf_model.model.layers)):
        layer = hf_model.model.layers[i]
        if i == s0:
            h_s0 = h
        mask = windowed(None, pos, pos, layer_window(hf_model, layer))
        h, kv = block(layer, h, mask, cos_sin[i], None, trainable.loras("base_lora", i), trainable.lora_scale)
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
    cos_sin = rotations(hf_model, x, positions)
    kpos = torch.cat([torch.arange(L, device=dev)[None].expand(B, L), positions], dim=1)
    prefix = "streams.lora" if lossless else "base_lora"
    for i in range(s0, len(hf_model.model.layers)):
        layer = hf_model.model.layers[i]
        m = windowed(mask, positions, kpos, layer_window(hf_model, layer))
        x, _ = block(layer, x, m, cos_sin[i], main.kv[i - s0], trainable.loras(prefix, i), trainable.lora_scale)
    return x.reshape(B, S, gamma, -1)


def stream_counts(spos, sweight, lengths, gamma: int) -> torch.Tensor:
    """(γ,) number of valid (position, stream) targets: the loss normaliser of every segment."""
    js = torch.arange(1, gamma + 1, device=spos.device)
    valid = ((spos[..., None] + 1 + js) < lengths[:, None, None]).float() * sweight[..., None]
    return valid.sum(dim=(0, 1))


@dataclass
class Teacher:
    """The frozen main stream's distributions at some positions: ``probs`` (M, V) and
    ``neg_entropy`` (M,) = Σ q log q, what the KL term needs of each row.

    A top-k teacher (:meth:`top_k`, what the feature cache stores) holds only the k most
    likely tokens: ``ids`` (M, k), ``probs`` (M, k), ``mass`` (M,) = their total, and
    ``neg_entropy`` over them; the KL term is then taken over the kept mass."""

    probs: torch.Tensor
    neg_entropy: torch.Tensor
    ids: Optional[torch.Tensor] = None
    mass: Optional[torch.Tensor] = None

    @staticmethod
    def from_logits(logits: torch.Tensor) -> "Teacher":
        logq = torch.log_softmax(logits.float(), dim=-1)
        q = logq.exp()
        return Teacher(q, (q * logq).sum(-1))

    @staticmethod
    def from_top_logprobs(ids: torch.Tensor, logq: torch.Tensor) -> "Teacher":
        """From the k best tokens' log-probabilities (M, k) and ids (M, k); rows whose
        log-probabilities are all -inf (padding) keep no mass."""
        q = logq.float().exp()
        return Teacher(q, (q * logq.float().clamp_min(-1e30)).sum(-1), ids.long(), q.sum(-1))


def teacher_table(hf_model, h_final: torch.Tensor, positions: torch.Tensor):
    """The teacher at the distinct (sequence, position) pairs of ``positions`` (B, ...),
    once per pair however many streams target it, and the row of each entry in it."""
    B, L = h_final.shape[:2]
    keys = positions + L * torch.arange(B, device=positions.device).view(B, *([1] * (positions.dim() - 1)))
    uniq, rows = torch.unique(keys, return_inverse=True)
    with torch.no_grad():
        table = Teacher.from_logits(lm_logits(hf_model, h_final.flatten(0, 1)[uniq]))
    return table, rows


def segment_loss(
    hf_model, trainable, cfg, main: MainPass, tokens, spos, sweight, lengths, n: torch.Tensor, s0, cached=None
):
    """This segment's share of the stream loss (normalised by the whole batch's ``n``) and its
    sums; ``cached``: the batch's teacher from the feature cache (else computed from the main pass)."""
    gamma = trainable.get("streams.embeddings").shape[0]
    lossless = cfg.mode == "lossless"
    B, L = tokens.shape
    js = torch.arange(1, gamma + 1, device=tokens.device)
    hs = stream_pass(hf_model, trainable, main, spos, gamma, s0, lossless)
    tgt_pos = spos[..., None] + 1 + js
    valid = (tgt_pos < lengths[:, None, None]).float() * sweight[..., None]
    seg = spos.shape[1]
    tgt = torch.gather(tokens, 1, tgt_pos.clamp(0, L - 1).reshape(B, -1)).view(B, seg, gamma)
    w_ce = cfg.alpha_stream * valid / n
    w_kl, teacher, rows = None, None, None
    if lossless and cfg.distill:
        at = (spos[..., None] + js).clamp(0, L - 1)
        if cached is None:
            teacher, rows = teacher_table(hf_model, main.h_final, at)
        else:  # the cached teacher's rows are (sequence, position) of the batch, flattened
            teacher, rows = cached, at + L * torch.arange(B, device=at.device)[:, None, None]
        w_kl = cfg.distill_weight * w_ce
    loss, ce, kl, hit = head_loss(
        hf_model.model.norm(hs), hf_model.lm_head.weight, tgt, w_ce, w_kl, teacher, rows, cfg.loss_chunk
    )
    sums = [(t * valid).sum(dim=(0, 1)) for t in (ce, hit, kl)]
    return loss, *sums


def backward_segments(hf_model, trainable: TorchTrainable, cfg, batch: Dict[str, torch.Tensor], s0: int, train=True):
    """Compute the loss of one batch and accumulate its gradients, one segment at a time.

    Returns the metrics (loss, stream_ce, stream_acc, ... as floats/lists), like the MLX
    objective. ``train=False``: the metrics only (validation), no graph is built."""
    dev = batch["tokens"].device.type
    with torch.set_grad_enabled(train), torch.autocast(dev, torch.bfloat16, enabled=cfg.precision == "bfloat16"):
        return _backward_segments(hf_model, trainable, cfg, batch, s0, train)


def _backward_segments(hf_model, trainable: TorchTrainable, cfg, batch: Dict[str, torch.Tensor], s0: int, train):
    tokens, loss_mask, spos, sweight, lengths = (
        batch[k] for k in ("tokens", "loss_mask", "spos", "sweight", "lengths")
    )
    lossless = cfg.mode == "lossless"
    gamma = trainable.get("streams.embeddings").shape[0] if cfg.streams else 0
    metrics: dict = {}
    cached = batch.get("teacher")
    if "h_s0" in batch and not lossless:
        raise ValueError("cached features are for lossless training (the base below the streams is frozen)")
    if lossless:
        with torch.no_grad():
            if "h_s0" in batch:
                main = main_from_features(hf_model, batch["h_s0"], s0)
            else:
                main = main_pass(hf_model, trainable, tokens, s0)
        leaves = main
    else:
        main = main_pass(hf_model, trainable, tokens, s0)
        leaves = MainPass.from_tensors(
            [t.detach().requires_grad_(train and not cfg.isolate_streams) for t in main.tensors()],
            main.h_final.detach(),
        )
    lm = loss_mask[:, :-1]
    n_main = lm.sum().clamp(min=1.0)
    dev = tokens.device
    main_term = torch.zeros((), device=dev)
    if not lossless:
        h = hf_model.model.norm(main.h_final[:, :-1])
        main_term, ce, _, hit = head_loss(
            h, hf_model.lm_head.weight, tokens[:, 1:], cfg.alpha_main * lm / n_main, chunk=cfg.loss_chunk
        )
        metrics["main_ce"] = float((ce * lm).sum() / n_main)
        metrics["main_acc"] = float((hit * lm).sum() / n_main)
    total = float(main_term.detach())
    if cfg.streams:
        n = stream_counts(spos, sweight, lengths, gamma).clamp(min=1.0)
        sums = [torch.zeros(gamma, device=dev) for _ in range(3)]
        for s in range(0, spos.shape[1], cfg.segment):
            sl = slice(s, s + cfg.segment)
            loss, *parts = segment_loss(
                hf_model, trainable, cfg, leaves, tokens, spos[:, sl], sweight[:, sl], lengths, n, s0, cached
            )
            if train:
                loss.backward()  # frees this segment's graph; gradients accumulate
            total += float(loss.detach())
            sums = [a + b for a, b in zip(sums, parts)]
        metrics["stream_ce"] = (sums[0] / n).cpu().tolist()
        metrics["stream_acc"] = (sums[1] / n).cpu().tolist()
        if lossless and cfg.distill:
            metrics["stream_kl"] = (sums[2] / n).cpu().tolist()
        # Pruning adapter: early-exit next-token prediction at the insertion layer, at the
        # stream positions (the MLX objective's prune_loss).
        down, up = trainable.get("streams.pruning.down"), trainable.get("streams.pruning.up")
        h = torch.gather(main.h_s0, 1, spos[..., None].expand(-1, -1, main.h_s0.shape[-1])).detach()
        ee = frozen_norm(hf_model, h + (h @ down) @ up)
        weight = hf_model.lm_head.weight.detach()
        n_prune = sweight.sum().clamp(min=1.0)
        prune_loss, ce, _, _ = head_loss(
            ee, weight, torch.gather(tokens, 1, spos + 1), cfg.alpha_stream * sweight / n_prune, chunk=cfg.loss_chunk
        )
        if train:
            prune_loss.backward()
        total += float(prune_loss.detach())
        metrics["prune_ce"] = float((ce * sweight).sum() / n_prune)
    if train and not lossless:
        # The gradients reaching the main pass's outputs, sent through it once (isolated
        # streams send none: the main loss alone).
        outs, grads = [main_term], [torch.ones((), device=dev)]
        if not cfg.isolate_streams:
            outs += main.tensors()
            grads += [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves.tensors()]
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


def calibration_positions(hf_model, trainable: TorchTrainable, tokens: torch.Tensor, s0: int, chunk: int = 64):
    """Early-exit probabilities of the main stream's top-4 choices at every position
    (B, L, 4): the torch side of :mod:`.calibrate` (vocabulary-wide tensors for ``chunk``
    positions at a time)."""
    bf16 = hf_model.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad(), torch.autocast(tokens.device.type, torch.bfloat16, enabled=bf16):
        main = main_pass(hf_model, trainable, tokens, s0)
        down, up = trainable.get("streams.pruning.down"), trainable.get("streams.pruning.up")
        out = []
        for s in range(0, tokens.shape[1], chunk):
            h, h0 = main.h_final[:, s : s + chunk], main.h_s0[:, s : s + chunk]
            order = lm_logits(hf_model, h).topk(4, dim=-1).indices  # not a (rows × V) argsort
            p_ee = torch.softmax(lm_logits(hf_model, h0 + (h0 @ down) @ up).float(), dim=-1)
            out.append(torch.gather(p_ee, -1, order))
        return torch.cat(out, dim=1)

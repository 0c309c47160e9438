#!/usr/bin/python3
"""The PyTorch peer of kuai's LLaMA: the same model, trained on synthetic tokens, timed per step.

This file is the one PyTorch definition of the LLaMA-family model, beside torch_gpt.py's GPT. It
is imported by tests/golden/make_golden.py (which writes tests/golden/tiny_llama.safetensors and
the Hugging-Face-layout fixture tests/golden/tiny_llama_hf/) and run as a benchmark by
bench/peer_compare.py. Run it with Debian's torch:

    /usr/bin/python3 bench/peers/torch_llama.py --threads 2 --steps 6

The model is LLaMA as Hugging Face's LlamaForCausalLM computes it, in plain PyTorch:
token embedding embed_tokens (V, C), no learned positions; n_layer pre-norm blocks
    x = x + o_proj(attn(input_layernorm(x)))
    x = x + down_proj(silu(gate_proj(h)) * up_proj(h)),   h = post_attention_layernorm(x)
a final RMSNorm model.norm and logits = lm_head(x) (V, C); with --tie_embeddings the lm_head is
embed_tokens.weight (logits = x @ embed_tokens.weight^T) and has no parameter of its own. No
Linear has a bias. With hd = C / H, Hkv = n_kv_head (divides H) and F = ffn_hidden, parameter
names and their order (named_parameters()) are the contract with kuai, and are Hugging Face's:

    model.embed_tokens.weight                            (V, C)
    model.layers.{i}.self_attn.q_proj.weight             (H*hd, C)
    model.layers.{i}.self_attn.k_proj.weight             (Hkv*hd, C)
    model.layers.{i}.self_attn.v_proj.weight             (Hkv*hd, C)
    model.layers.{i}.self_attn.o_proj.weight             (C, H*hd)
    model.layers.{i}.mlp.gate_proj.weight                (F, C)
    model.layers.{i}.mlp.up_proj.weight                  (F, C)
    model.layers.{i}.mlp.down_proj.weight                (C, F)
    model.layers.{i}.input_layernorm.weight              (C)
    model.layers.{i}.post_attention_layernorm.weight     (C)
    model.norm.weight                                    (C)
    lm_head.weight                                       (V, C)   absent when tied

Linear weights are in torch layout (out_features, in_features). F's default (ffn_hidden=0) is
LLaMA's rule: h = int(2 * 4 * C / 3), F = 256 * ceil(h / 256).

- RMSNorm(x) = weight * (x * rsqrt(mean(x^2, -1) + eps)), the normalisation computed in float32
  (float64 when x is float64) and cast back to x's dtype before the weight multiplies it.
- Rotary embeddings, Hugging Face's half-split layout: inv_freq = 1 / theta ** (arange(0, hd, 2)
  / hd) and the angles freqs = p * inv_freq for positions p = 0..T-1, both in float32;
  emb = cat(freqs, freqs); x' = x * cos(emb) + rotate_half(x) * sin(emb) with
  rotate_half(x) = cat(-x[..., hd/2:], x[..., :hd/2]); applied per head to q and k after the
  projections. cos and sin are evaluated in float32 (float64 for a float64 model).
- Grouped-query attention: query head h reads kv head h // (H / Hkv) (HF's repeat_kv); causal
  softmax(q k^T / sqrt(hd)) v, written as torch_gpt.py writes attention.
- Init (HF's LlamaPreTrainedModel._init_weights): every Linear weight and the embedding
  N(0, 0.02), RMSNorm weights 1; drawn from torch's global RNG in named_parameters() order.
- AdamW: weight decay on names ending in "_proj.weight" and on "lm_head.weight"; none on
  embed_tokens and the norms.

The loss (torch_gpt.loss_fn: mean cross-entropy, ignore_index -1), the timing loop, --precision
bf16 (forward and loss under torch.autocast("cpu", dtype=torch.bfloat16), backward outside it)
and the final line are torch_gpt.py's:
    RESULT tokens_per_s=<f> step_ms_median=<f> peak_rss_mib=<f> final_loss=<f>
where the median step time excludes the first (warm-up) step.
"""

import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch_gpt  # noqa: E402  (the shared timing loop)
from torch_gpt import loss_fn  # noqa: E402  (the shared loss, torch_gpt.py's)

INIT_STD = 0.02
ROPE_THETA = 10000.0
NORM_EPS = 1e-5
# Parameters whose names end in these get weight decay; all others (embed_tokens, the RMSNorm
# weights) get none.
DECAYED_SUFFIXES = ("_proj.weight", "lm_head.weight")


def default_ffn_hidden(d_model):
    """LLaMA's MLP width: two thirds of 4*C, rounded up to a multiple of 256."""
    h = int(2 * 4 * d_model / 3)
    return 256 * ((h + 255) // 256)


def compute_dtype(dtype):
    """float32 for float32 and narrower types, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, d_model, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x):
        input_dtype = x.dtype
        h = x.to(compute_dtype(input_dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)


def rope_cos_sin(T, hd, theta, dtype, device=None):
    """cos, sin of shape (T, hd) in dtype's compute type: HF's rotary tables for positions 0..T-1
    (inverse frequencies and angles in float32, the half-split layout emb = cat(freqs, freqs))."""
    exponents = torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd
    inv_freq = 1.0 / (theta ** exponents)  # (hd/2,), float32
    pos = torch.arange(T, dtype=torch.float32, device=device)
    freqs = pos[:, None] * inv_freq[None, :]  # (T, hd/2), float32
    emb = torch.cat((freqs, freqs), dim=-1).to(compute_dtype(dtype))  # (T, hd)
    return emb.cos(), emb.sin()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x, cos, sin):
    """x (B, heads, T, hd); cos, sin (T, hd)."""
    return x * cos + rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, d_model, n_head, n_kv_head):
        super().__init__()
        assert d_model % n_head == 0, "d_model must be divisible by n_head"
        assert n_head % n_kv_head == 0, "n_kv_head must divide n_head"
        self.n_head = n_head
        self.n_kv_head = n_kv_head
        self.hd = d_model // n_head
        self.q_proj = nn.Linear(d_model, n_head * self.hd, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_head * self.hd, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_head * self.hd, bias=False)
        self.o_proj = nn.Linear(n_head * self.hd, d_model, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        H, Hkv, hd = self.n_head, self.n_kv_head, self.hd
        q = self.q_proj(x).view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, Hkv, hd).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.v_proj(x).view(B, T, Hkv, hd).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if Hkv != H:
            # HF's repeat_kv: query head h reads kv head h // (H / Hkv).
            k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, T, hd)
            v = v.repeat_interleave(H // Hkv, dim=1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # (B, H, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v  # (B, H, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, H * hd)
        return self.o_proj(y)


class LlamaMLP(nn.Module):
    def __init__(self, d_model, ffn_hidden):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn_hidden, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_hidden, bias=False)
        self.down_proj = nn.Linear(ffn_hidden, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, d_model, n_head, n_kv_head, ffn_hidden, norm_eps):
        super().__init__()
        # Registration order is HF's: self_attn, mlp, input_layernorm, post_attention_layernorm.
        self.self_attn = LlamaAttention(d_model, n_head, n_kv_head)
        self.mlp = LlamaMLP(d_model, ffn_hidden)
        self.input_layernorm = RMSNorm(d_model, norm_eps)
        self.post_attention_layernorm = RMSNorm(d_model, norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class LlamaModel(nn.Module):
    def __init__(self, vocab_size, n_layer, n_head, n_kv_head, d_model, ffn_hidden, norm_eps):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(d_model, n_head, n_kv_head, ffn_hidden, norm_eps)
             for _ in range(n_layer)]
        )
        self.norm = RMSNorm(d_model, norm_eps)


class Llama(nn.Module):
    """LLaMA causal language model (HF LlamaForCausalLM's computation and parameter names)."""

    def __init__(self, vocab_size, n_layer, n_head, d_model, seq_len, n_kv_head=None,
                 ffn_hidden=0, rope_theta=ROPE_THETA, norm_eps=NORM_EPS, tie_embeddings=False):
        super().__init__()
        n_kv_head = n_head if not n_kv_head else n_kv_head
        ffn_hidden = ffn_hidden or default_ffn_hidden(d_model)
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.n_head = n_head
        self.n_kv_head = n_kv_head
        self.d_model = d_model
        self.ffn_hidden = ffn_hidden
        self.rope_theta = rope_theta
        self.norm_eps = norm_eps
        self.tie_embeddings = tie_embeddings
        self.model = LlamaModel(vocab_size, n_layer, n_head, n_kv_head, d_model, ffn_hidden,
                                norm_eps)
        self.lm_head = None if tie_embeddings else nn.Linear(d_model, vocab_size, bias=False)
        self.init_llama()

    @torch.no_grad()
    def init_llama(self):
        """HF init: N(0, 0.02) for Linear weights and the embedding, RMSNorm weights 1. Draws
        from torch's global RNG in named_parameters() order."""
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.fill_(1.0)
            else:
                p.normal_(0.0, INIT_STD)

    def forward(self, idx):
        """idx (B, T) int64 with T <= seq_len -> logits (B, T, V)."""
        B, T = idx.shape
        assert T <= self.seq_len, f"sequence length {T} exceeds seq_len {self.seq_len}"
        x = self.model.embed_tokens(idx)  # (B, T, C)
        cos, sin = rope_cos_sin(T, self.d_model // self.n_head, self.rope_theta, x.dtype,
                                idx.device)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        if self.lm_head is None:
            return F.linear(x, self.model.embed_tokens.weight)  # (B, T, V), tied
        return self.lm_head(x)  # (B, T, V)


def make_optimizer(model, lr, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8):
    """AdamW: the projections and an untied lm_head decayed, embed_tokens and norms not."""
    return torch_gpt.make_optimizer(model, lr, weight_decay, betas, eps, decayed=DECAYED_SUFFIXES)


def parse_args(argv):
    p = torch_gpt.peer_arg_parser("PyTorch LLaMA peer benchmark (synthetic tokens).")
    p.add_argument("--n_kv_head", type=int, default=0, help="kv heads (default: n_head)")
    p.add_argument("--ffn_hidden", type=int, default=0,
                   help="MLP width (default 0: 256 * ceil(int(8 * d_model / 3) / 256))")
    p.add_argument("--rope_theta", type=float, default=ROPE_THETA)
    p.add_argument("--norm_eps", type=float, default=NORM_EPS)
    p.add_argument("--tie_embeddings", action="store_true",
                   help="lm_head shares embed_tokens.weight (default: untied)")
    args = torch_gpt.parse_peer_args(p, argv)
    if args.n_kv_head == 0:
        args.n_kv_head = args.n_head
    if args.d_model % args.n_head or args.n_head % args.n_kv_head:
        p.error("n_head must divide d_model and n_kv_head must divide n_head")
    if (args.d_model // args.n_head) % 2:
        p.error("the head dimension d_model / n_head must be even (rotary embeddings)")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = Llama(args.vocab_size, args.n_layer, args.n_head, args.d_model, args.seq_len,
                  n_kv_head=args.n_kv_head, ffn_hidden=args.ffn_hidden,
                  rope_theta=args.rope_theta, norm_eps=args.norm_eps,
                  tie_embeddings=args.tie_embeddings)
    torch_gpt.train_and_report(model, make_optimizer(model, args.lr), args)


if __name__ == "__main__":
    main(sys.argv[1:])

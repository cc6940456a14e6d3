"""The models the tests compile: plain PyTorch, no spmd imports (what a user writes before
parallelizing), and Hugging Face models built from small configs with random weights."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Linear -> GELU -> Linear."""

    def __init__(self, dim: int = 16, hidden: int = 64, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 128
    seq: int = 32
    dim: int = 64
    heads: int = 4
    layers: int = 2
    sdpa: bool = True  # scaled_dot_product_attention, else explicit softmax attention
    bias: bool = True
    causal: bool = True  # False: bidirectional (ViT)
    flex: str | None = None  # FlexAttention in place of SDPA: "mask" (a causal block mask), "alibi" (+ a
    # per-head score_mod, which reads the head index)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads, self.sdpa, self.causal, self.flex = cfg.heads, cfg.sdpa, cfg.causal, cfg.flex
        self.q_proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.heads

        def split_heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, h, d // h).transpose(1, 2)

        q, k, v = split_heads(self.q_proj(x)), split_heads(self.k_proj(x)), split_heads(self.v_proj(x))
        if self.flex:
            y = _flex(q, k, v, self.flex, self.causal)
        elif self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(d // h)
            if self.causal:
                mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
                scores = scores.masked_fill(~mask, float("-inf"))
            y = scores.softmax(dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, s, d))


def _flex(q, k, v, kind: str, causal: bool) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, h, s, _ = q.shape

    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def alibi(score, b, h, q_idx, kv_idx):
        return score - (h + 1).to(score.dtype) / 8 * (q_idx - kv_idx).abs().to(score.dtype)

    mask = create_block_mask(causal_mask, None, None, s, s, device=q.device) if causal else None
    return flex_attention(q, k, v, score_mod=alibi if kind == "alibi" else None, block_mask=mask)


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, 4 * cfg.dim, bias=cfg.bias)
        self.fc2 = nn.Linear(4 * cfg.dim, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-style decoder: token + position embedding, blocks, final LayerNorm, LM head."""

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@dataclass(frozen=True)
class LlamaConfig:
    """LLaMA-style decoder. `LlamaConfig.llama3_8b()` has LLaMA 3 8B's shapes (32 layers, dim 4096,
    FFN 14336, 32 heads, 8 KV heads, vocab 128256)."""

    vocab: int = 128
    seq: int = 32
    dim: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 172
    layers: int = 2
    eps: float = 1e-5
    rope_theta: float = 500000.0

    @staticmethod
    def llama3_8b(layers: int = 32, seq: int = 8192) -> "LlamaConfig":
        return LlamaConfig(vocab=128256, seq=seq, dim=4096, heads=32, kv_heads=8, ffn=14336, layers=layers)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    """Grouped-query attention with rotary position embedding."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
        self.q_proj = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k = k[:, :, None].expand(b, self.kv_heads, rep, s, self.head_dim).reshape(b, self.heads, s, self.head_dim)
        v = v[:, :, None].expand(b, self.kv_heads, rep, s, self.head_dim).reshape(b, self.heads, s, self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attn = LlamaAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.ffn_norm(x))


class Llama(nn.Module):
    """A LLaMA-style decoder: embedding, pre-norm blocks (RMSNorm, GQA + RoPE, SwiGLU), LM head."""

    def __init__(self, cfg: LlamaConfig = LlamaConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        head_dim = cfg.dim // cfg.heads
        self.register_buffer("cos", torch.empty(cfg.seq, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(cfg.seq, head_dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The rotary tables (the model's own tensors; its children reset theirs)."""
        cfg, head_dim = self.cfg, self.cos.shape[-1]
        freqs = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float32), freqs)
        angles = torch.cat((angles, angles), dim=-1)
        with torch.no_grad():
            self.cos.copy_(angles.cos())
            self.sin.copy_(angles.sin())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


@dataclass(frozen=True)
class ViTConfig:
    """Vision transformer on patch tokens (patchify + Linear, same as a stride-`patch` convolution).
    `ViTConfig.vit_60b()` / `vit_120b()` are the sizes of the 2-D parallelism seed results."""

    image: int = 32
    patch: int = 8
    channels: int = 3
    dim: int = 64
    heads: int = 4
    layers: int = 2
    classes: int = 10

    @staticmethod
    def vit_60b(layers: int = 72) -> "ViTConfig":  # 12 * 8192^2 * 72 = 58B in the blocks
        return ViTConfig(image=224, patch=14, dim=8192, heads=64, layers=layers, classes=1000)

    @staticmethod
    def vit_120b(layers: int = 66) -> "ViTConfig":  # 12 * 12288^2 * 66 = 120B in the blocks
        return ViTConfig(image=224, patch=14, dim=12288, heads=96, layers=layers, classes=1000)


class ViTBlock(Block):
    def __init__(self, cfg: ViTConfig):
        super().__init__(GPTConfig(dim=cfg.dim, heads=cfg.heads, causal=False))


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig = ViTConfig()):
        super().__init__()
        self.cfg = cfg
        tokens = (cfg.image // cfg.patch) ** 2
        self.patch_embed = nn.Linear(cfg.channels * cfg.patch * cfg.patch, cfg.dim)
        self.pos_emb = nn.Parameter(torch.empty(1, tokens, cfg.dim))
        self.blocks = nn.ModuleList(ViTBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The position embedding (the model's own tensor; its children reset theirs)."""
        nn.init.zeros_(self.pos_emb)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b, c, h, w = images.shape
        p = self.cfg.patch
        patches = images.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)
        x = self.patch_embed(patches) + self.pos_emb
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x).mean(dim=1))


def gpt2(attn: str = "sdpa", layers: int = 2):
    """transformers' GPT-2 (tied embeddings), tiny, no dropout, no KV cache."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=128, n_positions=64, use_cache=False,
                     attn_implementation=attn, bos_token_id=0, eos_token_id=0,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).eval()


def tied_lm(name: str):
    """A transformers model whose output head is its input embedding (tied): gpt2, bert or gemma, tiny."""
    from transformers import BertConfig, BertForMaskedLM, GemmaConfig, GemmaForCausalLM, GPT2Config, GPT2LMHeadModel

    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                          use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if name == "bert":
        return BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0))
    return GemmaForCausalLM(GemmaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=64, use_cache=False))


class RoundSTE(torch.autograd.Function):
    """Straight-through estimator: rounds in forward, passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ScaleGrad(torch.autograd.Function):
    """Identity in forward, the gradient times 3 in backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return 3 * grad


class Quantized(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(ScaleGrad.apply(RoundSTE.apply(self.fc1(x) * 4) / 4))


def nanogpt_init(m: nn.Module) -> None:
    """nanoGPT's `_init_weights`: normal(0, 0.02) for Linear and Embedding weights, zero biases."""
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)


class NanoBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.c_fc, self.c_proj = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.c_proj(F.gelu(self.c_fc(self.ln(x))))


class NanoGPT(nn.Module):
    """karpathy/nanoGPT's construction: the embedding takes the head's weight (`earlier.weight =
    later.weight`), `self.apply(self._init_weights)`, then a scaled normal_ on every c_proj weight."""

    def __init__(self, vocab=64, d=32, layers=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(16, d)
        self.h = nn.ModuleList(NanoBlock(d) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def _init_weights(self, m):
        nanogpt_init(m)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

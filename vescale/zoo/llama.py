"""A small LLaMA-style causal language model in plain single-device PyTorch.

This is the zoo's reference model: it knows nothing about devices, meshes or plans, exactly like the
models users bring. Its module names, parameter names and call conventions (which arguments go by
keyword, what each module returns) are those of HuggingFace ``transformers.LlamaForCausalLM``, so a
plan's paths (``model.layers.3.self_attn.q_proj.weight``, ``model.layers.3.<in>``, ...) match both.

It does what real models do in ``forward`` and a parallel runtime has to cope with: position ids from
``torch.arange``, a causal mask from ``torch.full(...).triu``, rotary embeddings from a
non-persistent buffer, eager attention with dropout, grouped-query attention, and reshapes that take
the head count from the tensor (``view(*shape[:-1], -1, head_dim)``) so they stay right when heads
are sharded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "LlamaForCausalLM", "CausalLMOutput"]


@dataclass
class LlamaConfig:
    """Model sizes and regularisation. Field names and defaults follow HF's LlamaConfig (LLaMA-2 7B)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: one key/value head per query head (no GQA)
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_dropout: float = 0.0  # on the attention probabilities
    hidden_dropout: float = 0.0  # on each residual branch (HF's Llama has none; 0.0 matches it)
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads}); change one of them"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}); change one of them"
            )
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}; change hidden_size")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (as HF does) so low-precision activations keep their scale.
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.float()
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRotaryEmbedding(nn.Module):
    """Returns (cos, sin) of shape (1, seq, head_dim) for the given position ids."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim, self.theta = config.head_dim, config.rope_theta
        # Not persistent: derived from the config, so checkpoints do not carry it (HF does the same).
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float, device=device) / self.head_dim
        return 1.0 / (self.theta**exponents)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over the heads dimension
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, kv_heads, seq, head_dim) -> (batch, kv_heads * n_rep, seq, head_dim), each head n_rep times."""
    if n_rep == 1:
        return x
    batch, kv_heads, seq, head_dim = x.shape
    return x[:, :, None].expand(batch, kv_heads, n_rep, seq, head_dim).reshape(batch, kv_heads * n_rep, seq, head_dim)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.attention_dropout = config.attention_dropout
        q_size, kv_size = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        input_shape = hidden_states.shape[:-1]
        # -1 heads: the head count comes from the projection's output, which is smaller when sharded.
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        k, v = repeat_kv(k, self.num_key_value_groups), repeat_kv(v, self.num_key_value_groups)

        scores = torch.matmul(q, k.transpose(2, 3)) * self.head_dim**-0.5 + attention_mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = F.dropout(probs, p=self.attention_dropout, training=self.training)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(*input_shape, -1)
        # (output, attention probabilities), like HF, so `self_attn.<out>[0]` names the same tensor in both.
        return self.o_proj(out), probs


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()  # a module, as in HF, so module names match

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.hidden_dropout = config.hidden_dropout
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        # Functional dropout, not nn.Dropout modules: extra modules would break name parity with HF.
        attn_out, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
        )
        hidden_states = hidden_states + F.dropout(attn_out, p=self.hidden_dropout, training=self.training)
        mlp_out = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + F.dropout(mlp_out, p=self.hidden_dropout, training=self.training)


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        if seq_len > self.config.max_position_embeddings:
            raise ValueError(
                f"input_ids has {seq_len} positions but max_position_embeddings is "
                f"{self.config.max_position_embeddings}; shorten the input or raise the config value"
            )
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(seq_len, device=hidden_states.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        # Additive mask: -inf above the diagonal so a position never attends to later ones.
        causal_mask = torch.full(
            (seq_len, seq_len), float("-inf"), dtype=hidden_states.dtype, device=hidden_states.device
        ).triu(1)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=causal_mask, position_embeddings=position_embeddings)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        # The submodules' own default initialisation is overwritten below; keep it from drawing on
        # the generator, so that `manual_seed(s); LlamaForCausalLM(c)` and a later
        # `manual_seed(s); model.init_weights()` (e.g. after building on the meta device) agree.
        with _generator_untouched():
            self.model = LlamaModel(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialise every parameter in place, drawing from the default generator in module order.

        In place, so it also works after parameters were replaced (sharded, or moved off the meta
        device): it is how a runtime gives a transformed model the values this model would have had.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(mean=0.0, std=self.config.initializer_range)
            elif isinstance(module, LlamaRMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, LlamaRotaryEmbedding):
                module.inv_freq.copy_(module.compute_inv_freq(module.inv_freq.device))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
        hidden_states = self.model(input_ids=input_ids)  # by keyword, as HF calls its inner model
        logits = self.lm_head(hidden_states)
        loss = None if labels is None else causal_lm_loss(logits, labels)
        return CausalLMOutput(loss=loss, logits=logits)


def _generator_untouched():
    """Context that restores the CPU generator, and the default device's if it has its own, on exit."""
    device = torch.get_default_device()
    if device.type in ("cpu", "meta"):
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device], device_type=device.type)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross entropy of predicting token t+1 at position t, shifted the way HF shifts it.

    Only the labels move: they are padded with ``ignore_index`` on the right and shifted left, so the
    logits keep their full (batch, seq, vocab) shape and the last position is ignored.
    """
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=ignore_index
    )

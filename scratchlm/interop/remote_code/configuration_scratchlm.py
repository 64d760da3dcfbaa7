"""The configuration of a scratchlm model as transformers reads it: `AutoConfig.from_pretrained(DIR,
trust_remote_code=True)` builds a `ScratchlmConfig` from the directory's config.json.

The shape keeps transformers' usual names (`hidden_size`, `num_hidden_layers`, `max_position_embeddings`, ...),
which generation, lm-eval and other tools read. The model's switches keep scratchlm's names and values:

    norm               "pre" (RMSNorm before attention and feed-forward), "post" (after each residual
                       addition) or "none"
    positions          "rope" or "none" (NoPE)
    ffn                "swiglu" (W2 (silu(W1 x) * W3 x)), "silu" (W2 silu(W1 x)) or "relu2" (W2 relu(W1 x)^2)
    qk_norm            RMSNorm of each head's queries and keys before RoPE
    logit_softcap      c > 0: logits c * tanh(z / c); 0: none
    value_embeddings   n tables of values added to the attention values of the first n and the last n blocks
    unet_skips         block L - 1 - i also reads block i's output, weighted (i < L / 2)
    zero_init          how training initialised the output projections; it changes nothing here, and is kept
                       so that the checkpoint goes back into scratchlm with the configuration it came with

This file depends on transformers only.
"""

from transformers import PretrainedConfig

CHOICES = {"norm": ("pre", "post", "none"), "positions": ("rope", "none"), "ffn": ("swiglu", "silu", "relu2")}


class ScratchlmConfig(PretrainedConfig):
    model_type = "scratchlm"

    def __init__(
        self,
        vocab_size=10_000,
        max_position_embeddings=256,
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=None,
        intermediate_size=1344,
        rope_theta=10_000.0,
        rms_norm_eps=1e-5,
        norm="pre",
        positions="rope",
        ffn="swiglu",
        qk_norm=False,
        logit_softcap=0.0,
        value_embeddings=0,
        unet_skips=False,
        zero_init=False,
        tie_word_embeddings=False,
        use_cache=True,
        **kwargs,
    ):
        # Every argument but the two handled below becomes an attribute of the same name.
        settings = dict(locals())
        for name in ("self", "kwargs", "tie_word_embeddings", "__class__"):
            settings.pop(name, None)
        self.__dict__.update(settings, num_key_value_heads=num_key_value_heads or num_attention_heads)
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if hidden_size % num_attention_heads or num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "hidden_size must be a multiple of num_attention_heads, and num_attention_heads of "
                "num_key_value_heads"
            )
        if not 0 <= 2 * value_embeddings <= num_hidden_layers:
            raise ValueError("value_embeddings must lie between 0 and num_hidden_layers / 2")
        # Passed on rather than set: transformers 4's base class sets it from its own default otherwise.
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

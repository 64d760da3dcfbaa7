"""The Transformer language model.

- `config.py`: `ModelConfig`, the hyperparameters and ablation switches, saved in every checkpoint.
- `layers.py`: Linear, Embedding, RMSNorm — each from tensor operations, as are the modules below.
- `attention.py`: softmax, scaled dot-product and causal attention, `MultiHeadSelfAttention`.
- `positions.py`: RoPE, or no position encoding.
- `ffn.py`: the feed-forward networks: SwiGLU, SiLU, ReLU².
- `part.py`: how a model part is built, from the `ModelConfig` or the CS336 assignment-1 handout's arguments.
- `transformer.py`: `TransformerBlock` and `TransformerLM`.
- `kv_cache.py`: the key/value caches of generation (one batch of equal lengths) and serving (a row a sequence).
- `accounting.py`: parameters, FLOPs and training memory from formulas (`scratchlm accounting`).

The public names are exported from the top-level package (`from scratchlm import TransformerLM`); this
package imports nothing itself, so that reading a `ModelConfig` does not load torch.
"""

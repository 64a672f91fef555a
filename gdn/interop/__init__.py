"""Weight import from the PyTorch world, one module per source: `seed` (the seed text's GatedDeltaNet class),
`fla` (flash-linear-attention's GatedDeltaNet and KimiDeltaAttention layers), `qwen3_next` (Hugging Face
transformers' Qwen3-Next GatedDeltaNet and gated attention). Each gives `*_config` (our config from the weights
and the source's config), `*_params` (our nested parameters) and `load_*` (a filled module). Sources are
state_dicts or safetensors paths.
"""

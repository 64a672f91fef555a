"""Weights between the PyTorch world and gdn, one module per source: `seed` (the seed text's GatedDeltaNet class),
`fla` (flash-linear-attention's GatedDeltaNet and KimiDeltaAttention layers, its GatedDeltaNetForCausalLM),
`qwen3_next` (Hugging Face transformers' Qwen3-Next GatedDeltaNet, gated attention and Qwen3NextForCausalLM). Each
gives `*_config` (our config from the weights and the source's config), `*_params` (our nested parameters) and
`load_*` (a filled module); `fla` and `qwen3_next` also `load_model` and `save_model` for whole causal LMs, on the
glue in `causal_lm`. Sources are state_dicts or safetensors paths.
"""

"""Language models at the Gated DeltaNet paper's sizes, trained on pre-tokenised files (Llama tokenizer, 4K context).

  gdn-train --config configs/lm_paper.py:gdn-1.3b \
      --config.data.text.train_file=data/train.bin --config.data.text.val_file=data/val.bin

The argument is MODEL-SIZE: MODEL one of `gdn` (Gated DeltaNet in every layer), `hybrid` (3:1 Gated DeltaNet and
global attention, "RRRA"), `transformer` (Transformer++: RoPE attention and SwiGLU in every layer); SIZE `340m` or
`1.3b`. The shapes are those of fla's flame training configs for these models (hidden size, layers, heads, head
dims, expand_v 2 for Gated DeltaNet, SwiGLU of 4 x 2/3 rounded up to a multiple of 256, untied embeddings,
vocabulary 32000):

| model | d_model | layers | mixer heads | parameters |
|---|---:|---:|---|---:|
| gdn 340m | 1024 | 21 | 6 q/k heads x 256, values 512 | 512,272,124 |
| hybrid 340m | 1024 | 21 | as gdn; attention layers 16 x 64 | 470,142,144 |
| transformer 340m | 1024 | 24 | 16 x 64 | 373,867,520 |
| gdn 1.3b | 2048 | 21 | 6 q/k heads x 256, values 512 | 1,387,348,732 |
| hybrid 1.3b | 2048 | 21 | as gdn; attention layers 32 x 64 | 1,345,157,312 |
| transformer 1.3b | 2048 | 24 | 32 x 64 | 1,364,297,728 |

The sizes are the paper's names for its model classes; the parameters (untied input and output embeddings of
32.8M / 65.5M included) are counted here, and the Gated DeltaNet counts equal those of fla's
`GatedDeltaNetForCausalLM` at the same config (tests/test_lm_paper.py holds all six).

Training follows the paper: AdamW (0.9, 0.95), peak 4e-4 cosine to 4e-5, weight decay 0.1, clipping 1.0, 0.5M
tokens a step (128 x 4096), 15B tokens for 340M and 100B for 1.3B, 1B tokens of warm-up. One GPU cannot hold 128
rows of 4096: lower data.batch_size (and raise train.steps) or spread the batch over devices (train.mesh_*).
The layers are scanned (`model.scan_layers`), which keeps compile time flat in depth, and rematerialised with
`model.remat=dots`: without remat, 8 rows of 4096 of the 340M shape asked XLA for 238 GiB on an H200, while the
1.3B model with `dots` trained at 8 x 4096 in a 62.9 GiB peak (results/benchmarks/h200_2026-12-01/).
"""

from configs import base
from gdn.train.config import ConfigError

MODELS = ("gdn", "hybrid", "transformer")
SIZES = {  # d_model, recurrent layers' count, attention heads (64 wide), tokens to train on
    "340m": dict(d_model=1024, layers=21, transformer_layers=24, attention_heads=16, tokens=15e9),
    "1.3b": dict(d_model=2048, layers=21, transformer_layers=24, attention_heads=32, tokens=100e9),
}
SEQ_LEN, BATCH = 4096, 128
MLP_RATIO = 4.125  # SwiGLU hidden = 4.125 * 2/3 * d_model: fla's 4 x 2/3 rounded up to 256 (2816, 5632)


def parse(spec: str) -> tuple:
  model, _, size = spec.partition("-")
  if model not in MODELS or size not in SIZES:
    raise ConfigError(f"config argument must be MODEL-SIZE with MODEL in {MODELS} and SIZE in {tuple(SIZES)} "
                      f"(e.g. configs/lm_paper.py:gdn-1.3b), got {spec!r}")
  return model, size


def get_config(spec="gdn-340m"):
  model, size = parse(spec)
  s = SIZES[size]
  c = base.get_config()
  c.name = f"lm_paper_{model}_{size}"
  c.data.task = "tokens"
  c.data.batch_size = BATCH
  c.data.eval_batch_size = 16
  c.data.text.seq_len = SEQ_LEN
  c.data.text.eval_examples = 256
  c.data.text.vocab_size = c.model.vocab_size = 32000
  c.data.text.token_dtype = "uint16"
  pattern = {"gdn": "R", "hybrid": "RRRA", "transformer": "A"}[model]
  base.apply(c, base.mixer("attention") if model == "transformer" else base.mixer("gated_deltanet",
                                                                                 pattern=pattern))
  d = s["d_model"]
  c.model.d_model = d
  c.model.num_layers = s["transformer_layers"] if model == "transformer" else s["layers"]
  c.model.mlp_ratio = MLP_RATIO
  c.model.tie_embeddings = False
  c.model.dtype = "bfloat16"
  c.model.scan_layers = True
  c.model.remat = "dots"
  c.model.recurrent.num_heads = 6
  c.model.recurrent.head_dim = 256
  c.model.recurrent.v_head_dim = 512
  c.model.attention.num_heads = s["attention_heads"]
  c.model.attention.head_dim = d // s["attention_heads"]
  steps = int(s["tokens"] // (BATCH * SEQ_LEN))
  c.train.steps = steps
  c.train.warmup_steps = int(1e9 // (BATCH * SEQ_LEN))
  c.train.learning_rate, c.train.min_lr_ratio = 4e-4, 0.1
  c.train.weight_decay, c.train.grad_clip = 0.1, 1.0
  c.train.b1, c.train.b2 = 0.9, 0.95
  c.train.eval_every = c.train.checkpoint_every = 2000
  return c

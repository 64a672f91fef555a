"""MQAR as Zoology trains it for its Figure 2 (Arora et al. 2023), attention and Gated DeltaNet, 3 seeds.

  gdn-compare --config configs/mqar_zoology.py          # GPU: 2 models x 3 settings x d_model 64-512, 3 seeds x 4 rates
  gdn-compare --config configs/mqar_zoology.py:d128     # one width (arg d<width>): the same grid at d_model 128
  gdn-compare --config configs/mqar_zoology.py:small    # CPU check of the pipeline: length 64, d_model 64, 400 steps
  gdn-compare --config configs/mqar_zoology.py:ablate   # GPU: attention at (64, 4), d_model 128, with one of
                                                        # configs/mqar.py's differences from Zoology at a time,
                                                        # all six, and all six but one (14 groups of 9 cells)

Copied from Zoology's figure-2 sweep (zoology/experiments/paper_configs/iclr24_zoology_figure2): one model per
(length, pairs) setting, (64, 4), (128, 8), (256, 16), trained and evaluated on that setting alone; vocabulary
8192 (keys from the lower half, values from the upper); power-law query gaps (a = 0.01); no random tokens
between the queries (random_non_queries False); batch 512 at lengths 64 and 128, 256 at length 256; 64 epochs
of 100,000 examples as steps (12,500 at batch 512, 25,000 at 256); evaluation on 3,000 examples; early stop at
0.99 accuracy; learning rates logspace(-4, -2, 4) for every model; d_model 64, 128, 256, 512; 2 layers; no
MLP (Zoology's state mixer is the identity); one attention head of width d_model with biases; AdamW as
PyTorch's defaults (weight decay 0.01 on every matrix, embeddings included; betas 0.9, 0.999), no gradient
clipping, cosine decay to 0 without warmup; tied embeddings, init std 0.02, output projections scaled by
1 / sqrt(2 L).

Not copied: RoPE instead of learned absolute position embeddings; RMSNorm instead of LayerNorm; no dropout
(Zoology: 0.1 on attention weights and embeddings); fresh examples every step instead of 64 passes over a
fixed 100,000 (as many sequences, none repeated); the cosine per step instead of per epoch; evaluation every
500 steps instead of every epoch (196 steps); norms and biases not decayed; float32 matmuls as JAX computes them
by default (TF32 operands on the H200), where PyTorch's default is float32 (`train.matmul_precision=float32`
copies that). Zoology's figure 2 has no Gated
DeltaNet: ours runs with the same block (one head, no MLP) and grid.
"""

from configs import base

LRS = (1e-4, 4.6e-4, 2.2e-3, 1e-2)  # np.logspace(-4, -2, 4), rounded
EXAMPLES, EPOCHS = 100_000, 64
SETTINGS = ((64, 4, 512), (128, 8, 512), (256, 16, 256))  # length, pairs, batch
WIDTHS = (64, 128, 256, 512)
CHECKPOINT_EVERY = 2500  # so that a run cut by a command's time limit resumes from at most 2,500 steps back


def setting(T: int, P: int, batch: int, d_model: int) -> tuple:
  steps = EPOCHS * EXAMPLES // batch
  return (f"data.mqar.train_settings=(({T},{P}),)", f"data.mqar.eval_settings=(({T},{P}),)",
          f"data.batch_size={batch}", f"data.eval_batch_size={min(batch, 500)}", f"train.steps={steps}",
          f"train.checkpoint_every={min(steps, CHECKPOINT_EVERY)}") + base.width(d_model, num_heads=1)


# configs/mqar.py's recipe, difference by difference (its attention stayed on the recall plateau; this recipe's
# does not): each setting changes one thing from the control toward it.
ABLATIONS = {
    "zoology": (),
    "swiglu_mlp": ("model.mlp_ratio=4.0",),
    "two_heads": base.width(128, num_heads=2),
    "optimizer": ("train.grad_clip=1.0", "train.weight_decay=0.1", "train.decay_embeddings=false", "train.b2=0.95",
                  "train.min_lr_ratio=0.1", "train.warmup_steps=500"),
    "batch_128": ("data.batch_size=128",),
    "random_tokens": ("data.mqar.random_non_queries=true",),
    "length_mixture": ("data.mqar.train_settings=((64,4),(128,8),(256,16),(512,64))",),
}
# All six differences at once (configs/mqar.py's recipe at d_model 128, evaluated at (64, 4), but with the control's
# projection biases and 12,500-step schedule), and each left out in turn: if no difference alone keeps attention on
# the plateau, these say which ones it takes together.
DIFFERENCES = [k for k in ABLATIONS if k != "zoology"]
COMBINED = {"all": sum((ABLATIONS[k] for k in DIFFERENCES), ())} | {
    f"all_but_{k}": sum((ABLATIONS[j] for j in DIFFERENCES if j != k), ()) for k in DIFFERENCES}


def get_config(size="full"):
  arg = size
  small = arg == "small"
  widths = (int(arg[1:]),) if arg.startswith("d") and arg[1:].isdigit() else WIDTHS
  if arg not in ("full", "small", "ablate") and len(widths) == 4:
    raise ValueError(f"config argument must be 'full', 'small', 'ablate' or d<width> (e.g. d128), got {arg!r}")
  c = base.get_config()
  c.name = "mqar_zoology" + ("" if arg == "full" else f"_{arg}")
  base.task(c, "mqar", batch_size=512, vocab_size=8192, num_layers=2)
  c.data.mqar.random_non_queries = False
  c.data.mqar.power_a = 0.01
  c.data.mqar.eval_examples = 3000
  c.model.mlp_ratio = 0.0
  c.model.attention.proj_bias = True
  base.apply(c, base.width(128, num_heads=1) + base.mixer("attention"))
  base.schedule(c, EPOCHS * EXAMPLES // 512, 0, every=500)
  c.train.min_lr_ratio = 0.0
  c.train.weight_decay = 0.01
  c.train.decay_embeddings = True
  c.train.b2 = 0.999
  c.train.grad_clip = 0.0
  c.train.early_stop = 0.99
  c.train.progress_bar = False
  # The head and the loss at the P query positions of a row only: the same loss and gradients, a T / P-th of the
  # head's work and logits (XLA's estimate on CPU: 7.1 -> 1.3 GiB for a (256, 16) cell at batch 256;
  # results/benchmarks/cpu_2026-12-02/supervised_head.txt). The d_model-128 grid's records were trained before it,
  # with the head everywhere.
  c.train.supervised_head = True
  c.sweep.models = {"attention": base.mixer("attention"), "gated_deltanet": base.mixer("gated_deltanet")}
  c.sweep.settings = {f"T{T}_P{P}_d{d}": setting(T, P, B, d) for T, P, B in SETTINGS for d in widths}
  c.sweep.seeds = (0, 1, 2)
  c.sweep.learning_rates = LRS
  c.sweep.x_key = "model.d_model"
  if arg == "ablate":  # 3,000 steps: the control leaves the plateau by step 500 at 2.2e-3 (results/mqar_zoology_d128)
    c.sweep.models = {"attention": base.mixer("attention")}
    c.sweep.settings = {k: setting(64, 4, 512, 128) + v + ("train.stop_step=3000",)
                        for k, v in (ABLATIONS | COMBINED).items()}
    c.sweep.learning_rates = (4.6e-4, 2.2e-3, 1e-2)
    c.sweep.x_key = ""
  if small:
    c.data.mqar.eval_examples = 256
    c.sweep.settings = {f"T64_P4_d{d}": setting(64, 4, 64, d) + ("train.steps=400", "train.checkpoint_every=400")
                        for d in (64,)}
    c.sweep.seeds = (0,)
    c.sweep.learning_rates = (1e-3,)
    c.train.eval_every = 100
    base.cpu(c)
  return c

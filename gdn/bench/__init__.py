"""Benchmark helpers that the scripts in `experiments/` share: timing and memory (`timing`), the op's roofline
floor (`roofline`), the op benchmark's shapes and inputs (`op_inputs`), the plain-port baseline (`plain_port`),
and the FLOP count of a whole model's training step (`model_flops`)."""

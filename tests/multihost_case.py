"""The model and requests of the multi-process test, shared by the test and its worker."""

import numpy as np

from ee_jax.models.exits.config import ExitConfig
from ee_jax.testing import tiny_model

MODEL = tiny_model(seed=5, n_heads=8, n_kv_heads=2, head_dim=8, eos_token_ids=())
PROMPTS = [np.random.default_rng(2).integers(3, 128, n).tolist() for n in (5, 19, 2, 11)]
NEW = 6
CONFIG = dict(max_num_seqs=4, max_model_len=32, page_size=4, num_pages=40,
              max_prefill_chunk=16, batch_buckets=(4,))
# every decode row leaves at layer 2 and is back-filled; one row stage (min_row_bucket = the
# batch), as a TPU pod serves per_row (`served_min_row_bucket`)
EXITS = ExitConfig(exit_layers=(1, 2, 3), policy="per_row", force_exit_layer=2, min_row_bucket=4)

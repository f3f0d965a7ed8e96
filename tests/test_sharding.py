"""Sharded serving on simulated CPU devices (conftest asks XLA for 8) against one device.

Tensor parallel splits matmul reductions across devices, so logits differ from one device's
by float rounding only: greedy tokens and back-filled cache entries must agree."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.config import ExitConfig
from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.params import greedy
from ee_jax.serving.sharding import MeshError, MeshSpec, logical_rules
from ee_jax.testing import tiny_model
from tests.reference import dense_greedy, run_requests

# 8 query heads, 2 KV heads (replicated once tp > 2), MLP 96 and vocabulary 128 divide by 8.
CFG, PARAMS = tiny_model(seed=5, n_heads=8, n_kv_heads=2, head_dim=8, eos_token_ids=())
RNG = np.random.default_rng(1)
PROMPTS = [RNG.integers(3, CFG.vocab_size, n).tolist() for n in (5, 19, 2, 11)]
NEW = 8
MESHES = [None, "tp=4", "tp=2,dp=2", "tp=8", "dp=8"]
POLICIES = {
    "full": None,
    "all": ExitConfig(exit_layers=(1, 2, 3), policy="all", force_exit_layer=2),
    # rows leave together at the forced exit: one row stage (min_row_bucket = the batch), as
    # meshes of accelerators serve per_row; test_sharded_verified_exits_are_full_depth
    # compiles the CPU's row stages under a mesh
    "per_row": ExitConfig(exit_layers=(1, 2, 3), policy="per_row", force_exit_layer=2,
                          min_row_bucket=4),
}

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8,
                                reason="needs 8 devices (XLA_FLAGS, set in conftest.py)")


def _serve(mesh: str | None, ec):
    engine = LLMEngine(CFG, PARAMS, None, EngineConfig.make(
        max_num_seqs=4, max_model_len=64, page_size=8, num_pages=40, max_prefill_chunk=16,
        batch_buckets=(4,), mesh=mesh), exit_config=ec)
    outs = run_requests(engine, PROMPTS, greedy(NEW))
    cache = engine.runner.cache
    return [o.token_ids for o in outs], np.asarray(cache.k), np.asarray(cache.v), engine


@pytest.fixture(scope="module")
def one_device():
    return {name: _serve(None, ec) for name, ec in POLICIES.items()}


# Every mesh and every policy, each mesh under an exit policy but data-parallel alone (not
# the whole product: each engine compiles its own programs for 8 devices, ~10-20 s a case in
# the suite); per_row with the KV heads split (tp=2) and replicated (tp=4), dp beside both.
CASES = [("tp=4", "per_row"), ("tp=2,dp=2", "all"), ("tp=2,dp=2", "per_row"),
         ("tp=8", "all"), ("dp=8", "full")]
assert {m for m, _ in CASES} == set(MESHES[1:]) and {p for _, p in CASES} == set(POLICIES)


@pytest.mark.parametrize("mesh, policy", CASES)
def test_sharded_engine_equals_one_device(one_device, mesh, policy):
    tokens, k, v, engine = _serve(mesh, POLICIES[policy])
    ref_tokens, ref_k, ref_v, _ = one_device[policy]
    assert tokens == ref_tokens
    if policy == "full":
        assert tokens == [dense_greedy(CFG, PARAMS, p, NEW) for p in PROMPTS]
    else:  # every decode token left at the forced exit: the back-fill wrote layers 2..3
        assert set(engine.stats.row_exit_counts) == {2}
    # The cache, back-filled entries included, equals one device's.
    np.testing.assert_allclose(k, ref_k, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v, ref_v, rtol=1e-5, atol=1e-5)
    spec = MeshSpec.parse(mesh)
    wq = engine.runner.params.layers.wq
    assert len(wq.sharding.device_set) == spec.size
    if spec.tp > 1:  # the query projection is split over heads, the cache over KV heads
        assert wq.addressable_shards[0].data.shape[-1] == wq.shape[-1] // spec.tp
        kv_split = logical_rules(CFG, engine.mesh)["kv_heads"] == "tp"
        assert kv_split == (CFG.n_kv_heads % spec.tp == 0)


@pytest.mark.parametrize("spec, match", [
    ("tp=3", "does not divide the model's n_heads"),
    ("dp=16", "needs 16 devices"),
    ("tp=2,pp=2", "cannot read mesh spec"),
    ("tp=0", "positive integer"),
    ("tp=2,tp=4", "twice"),
])
def test_bad_meshes_are_refused_clearly(spec, match):
    with pytest.raises(MeshError, match=match):
        LLMEngine(CFG, PARAMS, None, EngineConfig.make(max_model_len=64, page_size=4, num_pages=40,
                                                       mesh=spec))


@pytest.mark.parametrize("mesh", ["tp=2", "tp=4"])  # KV heads (2) split, and replicated
def test_sharded_step_never_gathers_the_cache(mesh):
    """Per layer only the Megatron all-reduces: no collective moves the KV cache."""
    import re

    from ee_jax.serving.model_runner import StepShape

    engine = LLMEngine(CFG, PARAMS, None, EngineConfig.make(
        max_num_seqs=4, max_model_len=64, page_size=4, num_pages=40, batch_buckets=(4,),
        mesh=mesh))
    r = engine.runner
    shape = StepShape(4, 1, 16, kind="decode")
    with jax.set_mesh(engine.mesh):
        hlo = r.lower(shape).compile().as_text()
    cache_dims = ",".join(str(d) for d in r.cache.k.shape[:3])  # [layers, pages, page_size, ..
    collectives = re.findall(r"\[([\d,]*)\][^ ]* (?:all-gather|all-reduce|all-to-all|"
                             r"collective-permute)", hlo)
    assert collectives, "a tensor-parallel step must have its all-reduces"
    assert not [c for c in collectives if c.startswith(cache_dims)], collectives


@pytest.mark.parametrize("rank, split", [(8, True), (6, False)])
def test_exit_heads_are_sharded_like_the_mlp_where_tp_divides(rank, split):
    from ee_jax.serving.sharding import param_shardings

    ec = ExitConfig(exit_layers=(1, 2), head="mlp", adapter_rank=rank)
    heads = exit_heads.init_heads(CFG, ec, PARAMS)
    mesh = MeshSpec.parse("tp=4").make_mesh()
    sh = param_shardings(heads, CFG, mesh)
    assert tuple(sh.mlp.down.spec) == (None, None, "tp" if split else None)
    assert tuple(sh.mlp.up.spec) == (None, "tp" if split else None, None)
    assert all(s is None for s in sh.norm.spec)  # [E, D]: replicated


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_gguf_block_weights_serve_sharded_in_their_blocks(tmp_path, qtype):
    """A GGUF's block weights (`quant.BlockQ`) on a tp=2 mesh stay blocks, each field split
    as the weight it stands for (column-parallel weights by output rows, row-parallel ones by
    input blocks: each device holds half the bytes); greedy tokens equal one device serving
    the blocks and the dense reference on the dequantized weights."""
    import gguf

    from ee_jax.models import quant
    from ee_jax.models.formats.gguf import load_gguf
    from tests.test_loaders import gguf_tiny_model, write_tiny_gguf

    cfg, params = gguf_tiny_model(eos_token_ids=())
    path = write_tiny_gguf(tmp_path / f"{qtype}.gguf", cfg, params,
                           gguf.GGMLQuantizationType[qtype])
    cfg, blocked = load_gguf(path, blocks=True)
    assert quant.has_blocks(blocked)
    dense = quant.dequantize_params(blocked)
    prompts = [np.random.default_rng(2).integers(3, cfg.vocab_size, n).tolist() for n in (7, 3)]
    runs = {}
    for mesh in (None, "tp=2"):
        engine = LLMEngine(cfg, blocked, None, EngineConfig.make(
            max_num_seqs=2, max_model_len=64, page_size=4, num_pages=40, max_prefill_chunk=16,
            batch_buckets=(1, 2), mesh=mesh))
        runs[mesh] = [o.token_ids for o in run_requests(engine, prompts, greedy(NEW))]
        layers = engine.runner.params.layers
        assert all(isinstance(getattr(layers, k), quant.BlockQ) for k in quant.QUANTIZED_KEYS)
        if mesh is not None:  # [L, out, in-bytes]: wq split by output rows, wo by inputs
            for key, axis in (("wq", 1), ("w_up", 1), ("wo", 2), ("w_down", 2)):
                w = getattr(layers, key)
                for a in (w.q_t, w.scale_t):
                    shard = a.addressable_shards[0].data.shape
                    assert shard[axis] * 2 == a.shape[axis], (key, a.shape, shard)
    assert runs["tp=2"] == runs[None] == [dense_greedy(cfg, dense, p, NEW) for p in prompts]


def test_a_mesh_built_by_the_caller_is_the_one_used_and_checked():
    """`LLM` builds the mesh once for the loader's placement and the engine: the engine then
    uses that very mesh, refuses one whose axes differ from `EngineConfig.mesh`, and one given
    without `EngineConfig.mesh`."""
    from ee_jax.serving.sharding import placement

    mesh = MeshSpec.parse("tp=2,dp=2").make_mesh()
    config = EngineConfig.make(max_model_len=64, page_size=4, num_pages=40, mesh="tp=2,dp=2")
    assert LLMEngine(CFG, PARAMS, None, config, mesh=mesh).mesh is mesh
    where = placement("tp=2,dp=2", mesh)(CFG)
    assert where(("layers", "wq"), 3).mesh is mesh
    with pytest.raises(MeshError, match="not the tp=4,dp=1"):
        LLMEngine(CFG, PARAMS, None, EngineConfig.make(max_model_len=64, page_size=4, num_pages=40,
                                                       mesh="tp=4"), mesh=mesh)
    with pytest.raises(MeshError, match=r"EngineConfig\.mesh is None"):
        LLMEngine(CFG, PARAMS, None, EngineConfig.make(max_model_len=64, page_size=4, num_pages=40),
                  mesh=mesh)


def test_sharded_verified_exits_are_full_depth():
    """Verified exits under a mesh (runs of drafts riding along on sharded weights, rows
    over dp, the run state replicated): full depth's tokens."""
    ec = ExitConfig(exit_layers=(1, 2, 3), policy="per_row", force_exit_layer=2).verified(3)
    tokens, _, _, engine = _serve("tp=2,dp=2", ec)
    assert tokens == [dense_greedy(CFG, PARAMS, p, NEW) for p in PROMPTS]
    assert engine.stats.num_drafted > 0

"""One process of the two-process test (tests/test_multihost.py), not a test itself.

    python tests/multihost_worker.py PORT NUM_PROCESSES PROCESS_ID [die_after_steps]

Every process builds the same tiny engine on a tp=4,dp=2 mesh over all processes' devices;
process 0 serves the prompts and prints the tokens as JSON; the others follow its steps.
"""

from __future__ import annotations

import json
import os
import sys

from ee_jax.serving import distributed

port, n, pid = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
die_after = int(sys.argv[4]) if len(sys.argv) > 4 else None
distributed.initialize(distributed.DistributedConfig(
    coordinator_address=f"127.0.0.1:{port}", num_processes=n, process_id=pid,
    local_cpu_devices=8 // n, heartbeat_timeout_s=5))
if os.environ.get("EE_JAX_TEST_XLA_CACHE"):  # the test's own folder: the second test loads
    from ee_jax.serving.compilation import enable_compilation_cache  # what the first compiled

    enable_compilation_cache(os.environ["EE_JAX_TEST_XLA_CACHE"])

import jax  # noqa: E402

from ee_jax.serving.engine import EngineConfig, LLMEngine  # noqa: E402
from ee_jax.serving.params import greedy  # noqa: E402
from tests.multihost_case import CONFIG, EXITS, MODEL, NEW, PROMPTS  # noqa: E402

cfg, params = MODEL
engine = LLMEngine(cfg, params, None, EngineConfig.make(**CONFIG, mesh="tp=4,dp=2"),
                   exit_config=EXITS)
if distributed.is_leader():
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, greedy(NEW))
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        steps += 1
    engine.stop_followers()
    print("TOKENS " + json.dumps([done[f"r{i}"] for i in range(len(PROMPTS))]), flush=True)
else:
    if die_after is not None:  # a follower that dies mid-run
        for _ in range(die_after):
            go, b, t, w, kind = distributed.broadcast_header(None).tolist()
            from ee_jax.serving.model_runner import StepShape

            shape = StepShape(b, t, w, kind=("decode", "prefill")[kind])
            engine.runner._launch(shape, distributed.broadcast_buffer(None, shape.size))
        os._exit(3)
    print(f"FOLLOWED {engine.follow()} {jax.process_index()}", flush=True)

"""/health stays live while a 20 MB body is being handled: reading, decoding, validating and
tokenizing a request all happen off the event loop.

The tokenizer here is the real one behind a double that takes a few seconds on a huge text
(as a real tokenizer does on 20 MB) and says when it starts and ends, so the test knows the
probe ran while the body was being handled. The 1 s bound is on a liveness property (the
event loop was free), not on speed: with tokenizing on the loop, the probe would wait the
whole tokenizing time.
"""

from __future__ import annotations

import json
import threading
import time

from engine.tokenizer import Tokenizer
from router.model_info import ModelInfo
from tests.router_fakes import TOKENS, ScriptedBackend, make_router_model_dir
from tests.security.edge_server import EdgeServer

BIG_BYTES = 20 * 1024 * 1024
TOKENIZE_SECONDS = 4.0
LIVENESS_BOUND_S = 1.0


class SlowTokenizer:
    """The real tokenizer; on a text over 1 MB it signals, stalls like a 20 MB tokenization,
    and tokenizes only a prefix (the test is about the stall, not the token ids)."""

    def __init__(self, real: Tokenizer):
        self._real = real
        self.started = threading.Event()
        self.finished = threading.Event()

    def __getattr__(self, name):
        return getattr(self._real, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= 1_000_000:
            return self._real.encode(text, add_special_tokens)
        self.started.set()
        time.sleep(TOKENIZE_SECONDS)
        self.finished.set()
        return self._real.encode(text[:20], add_special_tokens)


def test_health_answers_while_a_20mb_body_is_handled(tmp_path):
    model_dir = make_router_model_dir(tmp_path)
    real = Tokenizer(model_dir)
    slow = SlowTokenizer(real)
    # A context large enough that the 20 MB prompt passes the pre-tokenizer length check.
    info = ModelInfo(name="tiny", folder=str(model_dir), vocab_size=320,
                     max_model_len=50_000_000, eos_token_ids=(2,))
    body = json.dumps({"model": "tiny", "prompt": "hello world " * (BIG_BYTES // 12),
                       "max_tokens": 4}).encode()
    assert len(body) >= BIG_BYTES
    with EdgeServer(model_dir, ScriptedBackend(TOKENS), info=info, tokenizer=slow) as edge:
        result = {}
        big = threading.Thread(target=lambda: result.update(
            answer=edge.http("POST", "/v1/completions", body, timeout=120)))
        big.start()
        try:
            assert slow.started.wait(120), "the big body never reached the tokenizer"
            probes = []
            while not slow.finished.is_set() and len(probes) < 3:
                t0 = time.monotonic()
                status, health, _ = edge.http("GET", "/health", timeout=30)
                probes.append((time.monotonic() - t0, slow.finished.is_set(), status, health))
        finally:
            big.join(180)
    # at least one probe answered while the tokenizer was still busy with the big body
    during = [p for p in probes if not p[1]]
    assert during, f"no probe completed while the body was being tokenized: {probes}"
    for elapsed, _, status, health in during:
        assert status == 200 and health == {"status": "ok"}
        assert elapsed < LIVENESS_BOUND_S, f"/health took {elapsed:.2f} s"
    status, answer, _ = result["answer"]
    assert status == 200 and answer["choices"][0]["text"]

"""Speculative decoding counters: acceptance per draft position, acceptance length."""

from __future__ import annotations


class SpecMetrics:
    def __init__(self, num_speculative_tokens: int):
        self.k = num_speculative_tokens
        self.num_drafts = 0                      # draft rounds (one per sequence per step)
        self.num_draft_tokens = 0                # tokens proposed
        self.num_accepted_tokens = 0
        self.num_emitted_tokens = 0              # accepted + bonus/recovered
        self.num_decode_steps = 0
        self.proposed_per_position = [0] * num_speculative_tokens
        self.accepted_per_position = [0] * num_speculative_tokens

    def record(self, num_drafts: list[int], num_accepted: list[int]) -> None:
        """One verify step: per sequence, how many drafts it proposed and kept."""
        self.num_decode_steps += 1
        for k, a in zip(num_drafts, num_accepted, strict=True):
            self.num_emitted_tokens += a + 1
            if k == 0:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += a
            for j in range(k):
                self.proposed_per_position[j] += 1
                if j < a:
                    self.accepted_per_position[j] += 1

    def stats(self) -> dict:
        rounds = self.num_drafts
        return {
            "spec_num_drafts": rounds,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_num_proposed_per_position": list(self.proposed_per_position),
            "spec_num_accepted_per_position": list(self.accepted_per_position),
            # 1 + accepted / drafts: tokens a sequence gains per speculative step
            "spec_acceptance_length": (1.0 + self.num_accepted_tokens / rounds
                                       if rounds else None),
            "spec_acceptance_rate_per_position": [
                (a / p if p else None)
                for a, p in zip(self.accepted_per_position, self.proposed_per_position,
                                strict=True)],
            "spec_tokens_per_step": (self.num_emitted_tokens / self.num_decode_steps
                                     if self.num_decode_steps else None),
        }

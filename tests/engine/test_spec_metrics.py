"""SpecMetrics: acceptance length and the per-position counts the bench differences."""

from engine.speculative.metrics import SpecMetrics


def test_per_position_counts_and_acceptance_length():
    m = SpecMetrics(3)
    m.record([3, 3, 0], [0, 2, 0])      # third sequence drafted nothing this step
    m.record([2, 3], [2, 3])            # first one near max_tokens: only 2 drafts
    st = m.stats()
    assert st["spec_num_drafts"] == 4
    assert st["spec_num_draft_tokens"] == 11
    assert st["spec_num_accepted_tokens"] == 7
    assert st["spec_num_proposed_per_position"] == [4, 4, 3]
    assert st["spec_num_accepted_per_position"] == [3, 3, 1]
    assert st["spec_acceptance_rate_per_position"] == [0.75, 0.75, 1 / 3]
    assert st["spec_acceptance_length"] == 1 + 7 / 4
    # emitted: accepted + one bonus per sequence and step, drafting or not
    assert st["spec_tokens_per_step"] == (0 + 1 + 2 + 1 + 0 + 1 + 2 + 1 + 3 + 1) / 2


def test_stats_are_copies():
    m = SpecMetrics(2)
    m.record([2], [1])
    st = m.stats()
    st["spec_num_accepted_per_position"][0] = 99
    assert m.stats()["spec_num_accepted_per_position"] == [1, 0]

"""Memory planning: from a KV byte budget to slot classes (agent/engine/memory.py)."""
import pytest

from agent.engine.memory import MB, MemoryBudgetError, class_capacities, plan_slots

PER_TOKEN = 46_080  # SmolLM2's fp32 keys and values of one token
CAPS = class_capacities(8192)  # 256, 1024, 4096, 8192


def planned_bytes(classes) -> int:
    return sum(c.capacity_tokens * c.num_slots for c in classes) * PER_TOKEN


def test_a_budget_that_holds_the_full_context_keeps_one_full_slot_and_shares_the_rest():
    classes = plan_slots(500 * 2**20, PER_TOKEN, CAPS, min_context=512)
    by_cap = {c.capacity_tokens: c.num_slots for c in classes}
    assert by_cap[8192] == 1 and by_cap[256] > 1
    assert planned_bytes(classes) <= 500 * 2**20


def test_a_budget_below_the_full_context_gives_the_largest_slot_half_and_still_runs_several_requests():
    budget = 1640 * 2 * PER_TOKEN + 1000  # room for 3,280 tokens: one 3,280-token slot served one at a time
    classes = plan_slots(budget, PER_TOKEN, CAPS, min_context=512)
    assert max(c.capacity_tokens for c in classes) == 1640
    assert sum(c.num_slots for c in classes) >= 3
    assert planned_bytes(classes) <= budget


def test_the_largest_slot_never_drops_below_min_context():
    budget = 600 * PER_TOKEN  # half would be 300 tokens
    classes = plan_slots(budget, PER_TOKEN, CAPS, min_context=512)
    assert max(c.capacity_tokens for c in classes) == 512
    assert planned_bytes(classes) <= budget


def test_a_budget_below_one_min_context_sequence_is_refused():
    with pytest.raises(MemoryBudgetError, match="512-token sequence needs"):
        plan_slots(511 * PER_TOKEN, PER_TOKEN, CAPS, min_context=512)


@pytest.mark.parametrize("tokens", [512, 700, 1000, 2047, 2048, 5000, 8191, 8192, 9000, 20_000, 100_000])
def test_the_plan_never_exceeds_the_budget_and_always_fits_min_context(tokens):
    budget = tokens * PER_TOKEN
    classes = plan_slots(budget, PER_TOKEN, CAPS, min_context=512)
    assert planned_bytes(classes) <= budget
    assert max(c.capacity_tokens for c in classes) >= 512


@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.5, 0.9])
@pytest.mark.parametrize("min_context", [16, 512, 4096])
def test_the_budget_a_refusal_names_starts(fraction, min_context):
    """The required budget counts the prefix cache's share, so a budget of exactly what a refusal names
    starts: with it, the engine's own split (prefix blocks first, the rest to slots) leaves one min_context
    sequence."""
    from agent.engine.memory import required_budget_bytes

    per_token, block = 46_080, 16  # SmolLM2's fp32 KV bytes a token, the default prefix block
    baseline = 263 * MB
    kv_bytes = required_budget_bytes(baseline, per_token, min_context, fraction) - baseline
    prefix_blocks = int(kv_bytes * fraction) // (per_token * block)
    plan_slots(kv_bytes - prefix_blocks * per_token * block, per_token, class_capacities(8192, 256), min_context)
    with pytest.raises(MemoryBudgetError):  # and not much less would do
        short = int(min_context * per_token * 0.99)
        plan_slots(short - int(short * fraction) // (per_token * block) * per_token * block, per_token,
                   class_capacities(8192, 256), min_context)

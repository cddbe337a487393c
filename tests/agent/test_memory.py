"""Memory planning: from a KV byte budget to slot classes (agent/engine/memory.py); what a Mixture of Experts
counts against the budget and what one of its tokens costs a step (agent/engine/scheduler.attention_tokens)."""
import pytest

from agent.engine.memory import MB, MemoryBudgetError, class_capacities, describe_parameters, plan_slots
from agent.engine.scheduler import attention_tokens
from agent.wire import Geometry, Parameters

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


SMOLLM2 = dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
               num_heads=9, num_kv_heads=3, head_dim=64, context_length=8192, rope_theta=1e5, rms_norm_eps=1e-5,
               tie_word_embeddings=True)


def split(per_token: int) -> Geometry:
    """SmolLM2's MLPs as 8 experts of 192 neurons (tests/expert_split.py), per_token of them routed to."""
    return Geometry(**SMOLLM2 | dict(architecture="mixtral", intermediate_size=192, num_experts=8,
                                     num_experts_per_tok=per_token, moe_renormalize=True))


def test_a_moe_prompt_token_costs_its_routed_experts_not_one():
    """A prompt token of the split runs k experts of I/8 and the router: all 8 cost what the dense MLP does (to
    within the router's H*E), top-2 what a dense MLP of 2*I/8 does, and fewer experts cost less."""
    dense = attention_tokens(Geometry(**SMOLLM2))
    router = int(0.7 * 576 * 8 / (2 * 576)) + 1  # ATTENTION_EFFICIENCY * H * E / (2 * q)
    assert dense <= attention_tokens(split(8)) <= dense + router
    assert attention_tokens(split(1)) < attention_tokens(split(2)) < attention_tokens(split(4)) < dense
    dense_like_top2 = attention_tokens(Geometry(**SMOLLM2 | dict(intermediate_size=2 * 192)))
    assert dense_like_top2 <= attention_tokens(split(2)) <= dense_like_top2 + router


def test_a_mixture_of_experts_is_described_by_its_total_and_active_parameters():
    text = describe_parameters(Parameters(total=3_300_000_000, active=800_000_000))
    assert text == ("a Mixture of Experts of 3.30 B parameters, all resident in the memory budget, 800.0 M active "
                    "per token (what decode speed follows)")

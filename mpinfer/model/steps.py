"""How many tokens one engine step may carry: its decode rows (one a running sequence) and its
prompt tokens, capped by `server.max_prefill_tokens` (prompt tokens a step) and by
`server.max_step_tokens` (all of a step's tokens, vLLM's max_num_batched_tokens; 0: no cap).

The cap exists for the weight-only matmuls (kernels/): their in-register tiles are 64-256 rows,
so a step of 512 tokens fills two 256-row tiles where 544 (32 decode rows beside a 512-token
chunk) would run a third, mostly empty one, or dequantize every weight. The engine's scheduler
fills a step's prompt budget with what its decode rows leave; the runner captures a graph for
the largest step this allows, and the memory planner counts that step.
"""

from __future__ import annotations

# A step's prompt tokens never drop below this (one KV block) while prompts wait, even when the
# decode rows alone fill the cap: prompts still progress when max_batch_slots >= the cap.
MIN_PROMPT_TOKENS = 16


def prompt_budget(rows: int, max_prefill_tokens: int, max_step_tokens: int) -> int:
    """Prompt tokens a step with `rows` decode rows may carry."""
    if max_step_tokens <= 0:
        return max_prefill_tokens
    return min(max_prefill_tokens, max(max_step_tokens - rows, MIN_PROMPT_TOKENS))


def most_tokens(slots: int, max_prefill_tokens: int, max_step_tokens: int) -> int:
    """The most tokens any step of `slots` decode rows at most may carry."""
    return max(r + prompt_budget(r, max_prefill_tokens, max_step_tokens) for r in range(slots + 1))

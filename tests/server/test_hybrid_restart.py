"""A hybrid model restarted the way a user restarts it (issue 23, first step 1): `mlx-kvserve run`
as a process, a system prompt + question asked cold, again, and another question; SIGTERM; a new
process on the same folders; the first question again must hit the system prompt and give the cold
reply. The journey is scripts/journeys.py hybrid-restart's (scripts/harness/journey.py; run the script for
SmolLM2's tokenizer).

Each request takes up to four checkpoints after the system prompt's last full block (where the
user's message starts, where the assistant's turn starts, one short of the prompt's end, at the
reply's end), all tails of that one block: more than its per-parent limit. RAM keeps the
checkpoints used last, the shared one where the user's message starts among them; the SSD must
keep the same ones, or the restart finds none it can use."""

from __future__ import annotations

import pytest
from familymodels import build_family_model
from harness.journey import run_journey

# Two server processes per family (~10 s each on a laptop's CPU); tests/kv/ssd/test_ssd_tails.py checks the
# same without servers.
pytestmark = pytest.mark.slow

BS = 64  # the default block size
# With the byte tokenizer: the system message is 328 tokens, so the user's message starts at 328
# and both prompts (371 and 359 tokens) and their replies end inside the block 320..383.
SYSTEM = " ".join(f"Rule {i}: river {i} has the town {i * 7}." for i in range(11))
QUESTIONS = ("Which town is on river 3?", "And river 9?")


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2"])
def test_a_restarted_hybrid_server_hits_the_system_prompt_with_the_cold_reply(family, tmp_path):
    model = build_family_model(tmp_path / family, family)
    journey = run_journey(model, tmp_path / "home", SYSTEM, QUESTIONS)

    assert journey.shutdown_rc == 0
    assert journey.cold.cached_tokens == 0
    assert journey.again.cached_tokens == journey.cold.prompt_tokens - 1
    shared = journey.other.cached_tokens  # the system prompt, to where the user's message starts
    assert shared > 0
    # What this test is about: every checkpoint of both requests hangs off one block.
    assert shared // BS == (journey.cold.prompt_tokens - 1) // BS == (journey.other.prompt_tokens - 1) // BS
    assert journey.restarted.cached_tokens >= shared, journey
    assert journey.restarted.text == journey.cold.text

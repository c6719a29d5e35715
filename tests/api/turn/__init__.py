"""Tests of `api.turn`: the turn pipeline (admission, the prompt from stored ids, lead updates,
limits, commits)."""

"""Tests of `engine_patch`: the vLLM connector and the engine set-up (models, layouts, parallel ranks)."""

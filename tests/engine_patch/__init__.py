"""Tests of `engine_patch`: the connector (`connector/`) and the engine set-up (`setup/`)."""

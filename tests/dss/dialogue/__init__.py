"""Tests of `dss.dialogue`: versions, turn commits, stored responses, quotas, continuation."""

"""Tests of `engine_patch.connector`: copies, layouts, groups, both sides of the connector, real
engines through DSS."""

"""Tests of `api`: its own top-level modules and the whole server (each subpackage's tests are in
its folder)."""

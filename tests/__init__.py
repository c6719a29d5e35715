"""The test suite: one folder per package and room of the code it tests (tests/README.md)."""

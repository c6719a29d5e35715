"""Tests of `bench/`: every benchmark's smoke mode and reporting, and the short soak."""

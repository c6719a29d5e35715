"""Tests of `dss`: the Store facade as a whole here, each room in its own folder."""

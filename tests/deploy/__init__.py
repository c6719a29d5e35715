"""Tests of `deploy/`: a cluster of servers and the router in front of it."""

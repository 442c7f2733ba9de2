"""Tests of several shard distributions together; a package so that they share ``_workspace``."""

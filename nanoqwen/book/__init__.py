"""Helpers only the book's chapters (and the tests that check them) use: showing package code and
tables in a notebook, the barrier model checker of the paged-attention chapter and its figures,
and the teaching twins of product code (a deliberately racy attention kernel, the INT8-path
study). The runtime never imports this package."""

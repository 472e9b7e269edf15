"""Resolve: which artifact a node of some hardware should load from a model's channel, and why.

Resolve is the hot path (routers ask it on every failover). The route (`routes`) parses the query
(`query`), takes the channel's snapshot (`snapshots`: one indexed query, answered from `cache` while nothing
changed), reads the release's view (`views`, cached per snapshot), ranks every (artifact, pool) candidate
(`ranking`, with `fit` sizing each replica) and says why the first won (`explain`).
"""

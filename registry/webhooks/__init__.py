"""Webhooks: registry events (seals, promotions, weight changes, yanks) POSTed, signed, to subscribers.

`outbox` turns audit events into pending deliveries in the same transaction as the change;
`delivery` is the background sender (claims due deliveries, signs, retries with backoff);
`service` and `routes` are the admin API over webhooks and their delivery log.
"""

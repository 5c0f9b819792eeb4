-- Retention: running relays delete sent rows older than --retention, in batches, every 10 s. Without
-- an index each sweep would read the whole outbox to find them (139 ms per 500k rows even when none
-- is old enough). The update that marks a row sent already changes `status`, which the partial
-- indexes' predicates read, so it was never a HOT update: this adds one index entry per sent row.
CREATE INDEX outbox_sent_at_idx ON outbox (sent_at) WHERE status = 'sent';

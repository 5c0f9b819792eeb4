-- The relay's divergences (ARCHITECTURE.md, "The fence at the broker"): what the fence found when the
-- stream disagrees with the store about a row — the row's version is another event in the stream (a
-- store restored behind its stream), later versions are there but not this one, or a message on the
-- subject that is not the aggregate's. Such a row is never marked sent; its last finding is kept here,
-- typed, for `status`, the metrics and the console (NULL once the row is sent, or when the last
-- failure was not a divergence). JSON: {kind, stream_sequence, stream_msg_id, detail}.
ALTER TABLE outbox ADD COLUMN divergence JSONB;

-- `status` counts and lists them without walking the table: they are few, and any is an alert.
CREATE INDEX outbox_diverged_idx ON outbox (id) WHERE divergence IS NOT NULL;

-- The relay's journal of publishes that may have reached the broker without being settled.
--
-- A relay claims rows by locking them in one short transaction, publishes, then marks them in the same
-- transaction. If it dies in between, PostgreSQL rolls back and releases the locks, and nothing on the
-- rows says a publish happened. So before publishing, the relay records the batch here in its own,
-- committed statement; the settling transaction deletes the record (or keeps only the rows whose outcome
-- is unknown, e.g. an ack that timed out). A record that survives names events that may already be in the
-- stream: when they are published again, the relay knows whether that falls outside JetStream's dedupe
-- window and counts it (`waybill_relay_republished_outside_window_total`).
CREATE TABLE outbox_inflight (
    claim_id   UUID        PRIMARY KEY,
    relay      TEXT        NOT NULL,
    started_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    event_ids  UUID[]      NOT NULL
);

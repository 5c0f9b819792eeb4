-- The relay's fence at the broker, and claims that end wherever a relay stops (ARCHITECTURE.md,
-- "The fence at the broker" and "Claims end wherever a relay stops").

-- Every event of an aggregate is published on `<prefix>.<aggregate type>.<aggregate id>`; the relay
-- needs the aggregate type without parsing the body. Constant default: a catalogue-only change.
ALTER TABLE outbox ADD COLUMN aggregate_type TEXT NOT NULL DEFAULT 'order';

-- Each publish carries `Nats-Expected-Last-Subject-Sequence`: the stream sequence of the aggregate's
-- previous version, read from that version's row. The head check and that lookup are one probe into an
-- index over every row, sent or not: (aggregate_id, version − 1). It replaces the partial index of
-- unsent rows, which could not answer for a sent predecessor; followers (versions after a head) are
-- all unsent, so their range scan stays as short as before. Unique: one outbox row per event, and
-- events are unique per (aggregate_id, aggregate_version).
CREATE UNIQUE INDEX outbox_aggregate_version_idx ON outbox (aggregate_id, aggregate_version);
DROP INDEX outbox_unsent_by_aggregate_idx;
-- What the dropped index also served: `status` and `dead list` find dead rows without a scan.
CREATE INDEX outbox_dead_idx ON outbox (id) WHERE status = 'dead';

COMMENT ON COLUMN outbox.stream_seq IS
    'The JetStream stream sequence of the stored message (from the PubAck, or from the stream when the '
    'fence found the event already delivered; NULL when only a later version of the aggregate was found).';

-- Ends the claim transactions of relays that stopped mid-claim.
--
-- PostgreSQL ends an idle claim transaction by itself (`idle_in_transaction_session_timeout`), but not
-- one whose backend is still `active`: a relay frozen while PostgreSQL sends it a large claim result
-- leaves its backend blocked writing to the socket, holding every row lock, for as long as the freeze
-- lasts. Live relays call this (at most once a second) and end such sessions: a relay's transaction
-- older than its claim timeout can only belong to a relay that stopped, because every step settles well
-- within that time. Only sessions whose application_name starts with 'waybill-relay ' (how relays
-- name their connections) are touched, never the caller's own; the caller chooses only the age, which
-- has a floor of one second.
--
-- SECURITY DEFINER: the function runs as the role that ran the migrations, which must be able to see
-- and signal the relays' sessions (a superuser, or a member of pg_read_all_stats and
-- pg_signal_backend); relays themselves need only EXECUTE on it.
CREATE FUNCTION waybill_end_stale_claims(older_than interval) RETURNS integer
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog AS $$
    WITH stale AS MATERIALIZED (
        SELECT a.pid
        FROM pg_stat_activity a
        WHERE a.datname = current_database()
          AND a.backend_type = 'client backend'
          AND a.application_name LIKE 'waybill-relay %'
          AND a.pid <> pg_backend_pid()
          AND a.xact_start < now() - greatest(older_than, interval '1 second')
    )
    SELECT (count(*) FILTER (WHERE pg_terminate_backend(pid)))::integer FROM stale
$$;

REVOKE ALL ON FUNCTION waybill_end_stale_claims(interval) FROM PUBLIC;

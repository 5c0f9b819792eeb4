-- The publication a relay run with `--source wal` reads the outbox through (logical decoding, pgoutput;
-- docs/decisions/relay-wal.md). Inserts only: an outbox row is published once, when its transaction
-- commits, and the relays' own updates (marks, retries) and deletes (retention) are not events.
--
-- It costs nothing until a replication slot reads it (and nothing at all under wal_level = replica,
-- where PostgreSQL only warns that it cannot be used yet). Creating it needs the CREATE privilege on
-- the database: a migrating role without it gets a notice instead of a failed migration, and
-- `waybill-relay wal check` names the statement to run as the database's owner.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'waybill_outbox') THEN
        CREATE PUBLICATION waybill_outbox FOR TABLE outbox WITH (publish = 'insert');
    END IF;
EXCEPTION WHEN insufficient_privilege THEN
    RAISE NOTICE 'publication waybill_outbox not created (%): the WAL relay needs it; run as the database owner: CREATE PUBLICATION waybill_outbox FOR TABLE outbox WITH (publish = ''insert'')', SQLERRM;
END
$$;

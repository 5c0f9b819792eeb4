-- The event store and its transactional outbox (DESIGN.md, "Storage contract").
--
-- `events` is the immutable log: one row per event, ordered per aggregate by aggregate_version, which
-- optimistic concurrency makes commit-correct. `outbox` is the delivery state machine: one row per event
-- to publish, written in the same transaction as the event.

CREATE TABLE events (
    position          BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id          UUID        NOT NULL,
    event_type        TEXT        NOT NULL,
    event_version     INTEGER     NOT NULL CHECK (event_version >= 1),
    aggregate_type    TEXT        NOT NULL,
    aggregate_id      UUID        NOT NULL,
    aggregate_version BIGINT      NOT NULL CHECK (aggregate_version >= 1),
    occurred_at       TIMESTAMPTZ NOT NULL,
    recorded_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    correlation_id    UUID,
    causation_id      UUID,
    payload           JSONB       NOT NULL,
    CONSTRAINT events_event_id_key UNIQUE (event_id),
    -- The optimistic-concurrency guard: two writers at the same expected version collide here.
    CONSTRAINT events_aggregate_version_key UNIQUE (aggregate_id, aggregate_version)
);

COMMENT ON TABLE events IS 'Immutable event log; rows are never updated or deleted.';

-- Rows are never updated or deleted: enforce it, so no tool can rewrite history by accident.
CREATE FUNCTION events_are_immutable() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'events are immutable: % on events is not allowed', TG_OP
        USING ERRCODE = 'restrict_violation';
END
$$;

CREATE TRIGGER events_no_update_or_delete
    BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION events_are_immutable();

CREATE TRIGGER events_no_truncate
    BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION events_are_immutable();

CREATE TABLE outbox (
    id                BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The event this row delivers; the append writes exactly one outbox row per event.
    event_id          UUID        NOT NULL REFERENCES events (event_id),
    -- Routing facts and the exact message body, copied from the event when it is written, so that
    -- claiming and publishing never read `events` (a random lookup per row that cost the relay half
    -- its claim time) and the relay never re-encodes JSON.
    event_type        TEXT        NOT NULL,
    event_version     INTEGER     NOT NULL,
    aggregate_id      UUID        NOT NULL,
    aggregate_version BIGINT      NOT NULL,
    body              TEXT        NOT NULL,
    -- No `processing`: a claim is a row lock held by the relay's short transaction (ARCHITECTURE.md).
    status            TEXT        NOT NULL DEFAULT 'pending'
                      CHECK (status IN ('pending', 'sent', 'failed', 'dead')),
    attempts          INTEGER     NOT NULL DEFAULT 0,
    next_run_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_error        TEXT,
    created_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    sent_at           TIMESTAMPTZ,
    dead_at           TIMESTAMPTZ,
    dead_reason       TEXT,
    -- The relay instance and time of the claim that last settled the row.
    claimed_by        TEXT,
    claimed_at        TIMESTAMPTZ,
    -- The JetStream stream sequence from the PubAck.
    stream_seq        BIGINT,
    -- W3C trace context of the command that wrote the event, forwarded as a NATS header.
    traceparent       TEXT
);

COMMENT ON COLUMN outbox.body IS 'The NATS message body: the event envelope as JSON, exactly as published.';

-- The claim scans due, unsent rows only: without a partial index it would walk every sent row, and the
-- relay's rate decays as history grows (DESIGN.md, platform facts).
CREATE INDEX outbox_due_idx ON outbox (next_run_at, id)
    WHERE status IN ('pending', 'failed');

-- The per-aggregate head check ("is an earlier version still unsent?") must not walk sent rows either.
-- Dead rows are included: a dead head holds back its aggregate.
CREATE INDEX outbox_unsent_by_aggregate_idx ON outbox (aggregate_id, aggregate_version)
    WHERE status <> 'sent';

-- Idempotent commands: a retry with the same key returns the original result instead of writing again.
CREATE TABLE command_idempotency (
    idempotency_key   TEXT        PRIMARY KEY CHECK (length(idempotency_key) BETWEEN 1 AND 200),
    -- The command as first received; a reuse of the key for a different request is refused.
    request           JSONB       NOT NULL,
    aggregate_id      UUID        NOT NULL,
    aggregate_version BIGINT      NOT NULL,
    event_ids         UUID[]      NOT NULL,
    created_at        TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- The relay's journal of publishes that may have reached the broker without being settled.
--
-- A relay claims rows by locking them in one short transaction, publishes, then marks them in the same
-- transaction. If it dies in between, PostgreSQL rolls back and releases the locks, and nothing on the
-- rows says a publish happened. So before publishing, the relay records the batch here in its own,
-- committed statement; the settling transaction deletes the record (or keeps only the rows whose outcome
-- is unknown, e.g. an ack that timed out). A record that survives names rows that may already be in the
-- stream: when they are published again, the relay knows whether that falls outside JetStream's dedupe
-- window and counts it (`waybill_relay_republished_outside_window_total`).
CREATE TABLE outbox_inflight (
    claim_id   UUID        PRIMARY KEY,
    relay      TEXT        NOT NULL,
    started_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    outbox_ids BIGINT[]    NOT NULL
);

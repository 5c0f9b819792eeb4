//! A projection's home: its own schema (in whatever database its `DATABASE_URL` names), the runner's
//! bookkeeping tables, and the projection's tables. All are created on start and rebuilt by `rebuild`:
//! a projection's state can always be recomputed from the stream, so it has no migration history.

use sqlx::{AssertSqlSafe, PgConnection, PgPool};

use crate::inventory::Inventory;
use crate::points::Points;
use crate::projection::Projection;
use crate::search::Search;

/// Why a projection's schema could not be opened, checked, created, dropped or swapped.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    /// A schema name that is not ours (they are spliced into DDL).
    #[error(
        "invalid projection name {schema:?}: a lower-case letter, then lower-case letters, digits and _, at most {max}",
        max = MAX_NAME
    )]
    InvalidName { schema: String },
    #[error("creating or opening the database for the {schema} projection")]
    OpenDatabase {
        /// The projection's schema.
        schema: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("connecting the {schema} projection to PostgreSQL")]
    Connect {
        /// The projection's schema.
        schema: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("creating the {schema} projection's tables")]
    Create {
        /// The projection's schema.
        schema: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("reading the layout of schema {schema}")]
    ReadLayout {
        schema: String,
        #[source]
        source: sqlx::Error,
    },
    #[error(
        "schema {schema} was laid out by an older waybill (no held table, or parked headers as jsonb); \
         run `rebuild`, which builds the state beside it and then replaces it"
    )]
    OlderLayout { schema: String },
    #[error("dropping schema {schema}")]
    Drop {
        schema: String,
        #[source]
        source: sqlx::Error,
    },
    /// A rebuilt schema could not take the old one's name.
    #[error("renaming schema {from} to {to}")]
    Rename {
        /// The rebuilt schema.
        from: String,
        /// The name it was to take.
        to: String,
        #[source]
        source: sqlx::Error,
    },
}

/// The runner's tables, the same in every projection's schema:
/// - `checkpoints`: per aggregate, the last applied version (moved in the same transaction as the
///   data), the event that moved it (NULL when an operator released the order past a missing
///   version) and the order's total, which later events are checked against;
/// - `held`: events that arrived before their predecessor, acknowledged on the broker and kept here
///   until it is applied (so no number of gaps can fill the consumer's ack-pending window);
/// - `parked`: poison, with its reason; headers as JSON bytes (`bytea`: PostgreSQL's JSON types refuse
///   `\u0000`) and at most the first 64 KiB of the body, with its size and SHA-256;
/// - `operator_log`: who discarded, released or redrove what, when and why;
/// - `handover`: where each live consumer must continue after a rebuild's swap, written by the swap's
///   transaction and marked done once the consumer has moved (`handover.rs`);
/// - `aggregate_state`: what a read model of `src/models/` remembers of each aggregate, as JSON,
///   written in the batch's transaction (`kit.rs`; empty for the built-in projections).
const RUNNER_TABLES: &str = "
    CREATE TABLE IF NOT EXISTS checkpoints (
        aggregate_id UUID        PRIMARY KEY,
        version      BIGINT      NOT NULL,
        event_id     UUID,
        total_cents  BIGINT,
        updated_at   TIMESTAMPTZ NOT NULL DEFAULT now()
    );
    CREATE TABLE IF NOT EXISTS held (
        aggregate_id    UUID        NOT NULL,
        version         BIGINT      NOT NULL,
        event_id        UUID        NOT NULL,
        stream_sequence BIGINT,
        subject         TEXT        NOT NULL,
        headers         BYTEA       NOT NULL,
        body            BYTEA       NOT NULL,
        held_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
        PRIMARY KEY (aggregate_id, version)
    );
    CREATE INDEX IF NOT EXISTS held_by_age ON held (held_at);
    CREATE TABLE IF NOT EXISTS parked (
        id                BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        stream_sequence   BIGINT,
        subject           TEXT        NOT NULL,
        headers           BYTEA       NOT NULL,
        body              BYTEA       NOT NULL,
        body_size         BIGINT      NOT NULL,
        body_sha256       BYTEA       NOT NULL,
        reason            TEXT        NOT NULL,
        event_id          UUID,
        aggregate_id      UUID,
        aggregate_version BIGINT,
        parked_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
        redriven_at       TIMESTAMPTZ,
        redrive_note      TEXT,
        discarded_at      TIMESTAMPTZ,
        discarded_by      TEXT,
        discard_reason    TEXT
    );
    -- An older layout's parked table lacks these columns: `check_layout` names the problem then.
    DO $$ BEGIN
        CREATE INDEX IF NOT EXISTS parked_by_aggregate ON parked (aggregate_id, aggregate_version);
    EXCEPTION WHEN undefined_column THEN NULL;
    END $$;
    CREATE TABLE IF NOT EXISTS operator_log (
        id     BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        at     TIMESTAMPTZ NOT NULL DEFAULT now(),
        actor  TEXT        NOT NULL,
        action TEXT        NOT NULL,
        target TEXT        NOT NULL,
        reason TEXT        NOT NULL,
        detail JSONB       NOT NULL DEFAULT '{}'
    );
    CREATE TABLE IF NOT EXISTS aggregate_state (
        aggregate_id UUID  PRIMARY KEY,
        state        JSONB NOT NULL
    );
    CREATE TABLE IF NOT EXISTS handover (
        consumer       TEXT        PRIMARY KEY,
        start_sequence BIGINT      NOT NULL,
        token          UUID        NOT NULL,
        recorded_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
        moved_at       TIMESTAMPTZ
    );";

/// Creates the schema and tables if missing and returns a pool whose connections find them first
/// (`search_path` = the schema), so projection SQL stays unqualified.
pub async fn connect(
    database_url: &str,
    schema: &str,
    tables: &str,
) -> Result<PgPool, SchemaError> {
    check_name(schema)?;
    ops::database::ensure_database(database_url)
        .await
        .map_err(|source| SchemaError::OpenDatabase {
            schema: schema.to_owned(),
            source,
        })?;
    let pool = ops::database::connect_with(
        database_url,
        &format!("waybill-{schema}"),
        4,
        &[
            ("search_path", format!("{schema},public")),
            // Batches look rows up by `= ANY($1)`. A generic plan cached while a table was nearly empty
            // (right after a rebuild) can keep scanning it sequentially as it grows: the points
            // projection replayed 100k events at 8k/s in 2 of 3 runs with cached plans, and at 19-22k/s
            // in 5 of 5 with this setting. A batch's own transaction plans generically, with
            // sequential scans priced out (`runner::BATCH_PLANS`); everything else plans afresh.
            ("plan_cache_mode", "force_custom_plan".to_owned()),
        ],
    )
    .await;
    let connected = |source| SchemaError::Connect {
        schema: schema.to_owned(),
        source,
    };
    let pool = pool.map_err(connected)?;
    let mut conn = pool.acquire().await.map_err(connected)?;
    create(&mut conn, schema, tables).await?;
    Ok(pool)
}

/// Refuses a schema whose runner tables an older waybill laid out (before the held table, when
/// `parked.headers` was `jsonb`): `CREATE TABLE IF NOT EXISTS` leaves such tables as they are, and
/// parking into them would fail. `rebuild` replaces the schema with one in the current layout.
pub async fn check_layout(pool: &PgPool, schema: &str) -> Result<(), SchemaError> {
    let columns: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT table_name::text, column_name::text, data_type::text FROM information_schema.columns
         WHERE table_schema = $1 AND (table_name, column_name) IN
               (('parked', 'headers'), ('parked', 'body_sha256'), ('held', 'subject'),
                ('checkpoints', 'total_cents'))",
    )
    .bind(schema)
    .fetch_all(pool)
    .await
    .map_err(|source| SchemaError::ReadLayout {
        schema: schema.to_owned(),
        source,
    })?;
    let current = columns.len() == 4
        && columns
            .iter()
            .any(|(t, c, ty)| t == "parked" && c == "headers" && ty == "bytea");
    if !current {
        return Err(SchemaError::OlderLayout {
            schema: schema.to_owned(),
        });
    }
    Ok(())
}

/// Drops and recreates the schema with empty tables (inside the caller's transaction).
pub async fn reset(tx: &mut PgConnection, schema: &str, tables: &str) -> Result<(), SchemaError> {
    drop(tx, schema).await?;
    create(tx, schema, tables).await
}

/// Drops the schema and everything in it, if it exists.
pub async fn drop(conn: &mut PgConnection, schema: &str) -> Result<(), SchemaError> {
    check_name(schema)?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
    )))
    .execute(&mut *conn)
    .await
    .map_err(|source| SchemaError::Drop {
        schema: schema.to_owned(),
        source,
    })?;
    Ok(())
}

/// Puts schema `from` in the place of `to` (inside the caller's transaction): readers that name `to`
/// see `from`'s tables from the commit on. Connections resolve unqualified names through
/// `search_path` by schema name, so the live pools follow without reconnecting.
pub async fn replace(tx: &mut PgConnection, from: &str, to: &str) -> Result<(), SchemaError> {
    check_name(from)?;
    drop(tx, to).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER SCHEMA \"{from}\" RENAME TO \"{to}\""
    )))
    .execute(&mut *tx)
    .await
    .map_err(|source| SchemaError::Rename {
        from: from.to_owned(),
        to: to.to_owned(),
        source,
    })?;
    Ok(())
}

/// The console's database role (`waybill roles create` makes it, `store::roles`). The console reads
/// every projection's runner tables, but the schema belongs to the projection's login, and only an
/// owner can grant on it, so the projection does, each time it creates or opens its schema, when the
/// role exists. A role made later is granted at the projection's next start.
pub const CONSOLE_ROLE: &str = "waybill_console";

/// Grants the console the reading of the runner tables (inside [`create`]'s transaction, whose
/// search path is the schema) and, in a read model's schema (any `tables` but a built-in projection's),
/// of every table: the console shows a model's document. A built-in projection's own tables stay
/// unreadable to it. A login that does not own the schema gets a warning, not a failure to start: the
/// console then says it may not read them.
fn console_grants(schema: &str, tables: &str) -> String {
    let built_in = [Inventory::TABLES, Points::TABLES, Search::TABLES].contains(&tables);
    let model = !built_in;
    let model_tables = if model {
        format!("GRANT SELECT ON ALL TABLES IN SCHEMA \"{schema}\" TO {CONSOLE_ROLE};")
    } else {
        String::new()
    };
    format!(
        "DO $$ BEGIN
             IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{CONSOLE_ROLE}') THEN
                 GRANT USAGE ON SCHEMA \"{schema}\" TO {CONSOLE_ROLE};
                 GRANT SELECT ON checkpoints, held, parked, operator_log TO {CONSOLE_ROLE};
                 {model_tables}
             END IF;
         EXCEPTION WHEN insufficient_privilege THEN
             RAISE WARNING 'the console cannot be granted the reading of schema {schema}: only its owner can grant it';
         END $$;"
    )
}

async fn create(conn: &mut PgConnection, schema: &str, tables: &str) -> Result<(), SchemaError> {
    // One implicit transaction (several statements in one simple query): the lock serializes two
    // instances starting together, and SET LOCAL scopes the search path to this DDL.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "SELECT pg_advisory_xact_lock(hashtext('waybill.projection.schema'));
         CREATE SCHEMA IF NOT EXISTS \"{schema}\";
         SET LOCAL search_path = \"{schema}\";
         {RUNNER_TABLES} {tables}
         {grants}",
        grants = console_grants(schema, tables)
    )))
    .execute(&mut *conn)
    .await
    .map_err(|source| SchemaError::Create {
        schema: schema.to_owned(),
        source,
    })?;
    Ok(())
}

/// The longest projection name: PostgreSQL's identifiers end at 63 bytes, and a rebuild's schema
/// and consumer add a suffix to it.
const MAX_NAME: usize = 40;

/// Schema names are ours (the built-in three and the models' `NAME`s), but they are spliced into DDL:
/// a lower-case letter, then lower-case letters, digits and `_`, at most [`MAX_NAME`] of them.
pub(crate) fn check_name(schema: &str) -> Result<(), SchemaError> {
    let mut chars = schema.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_lowercase());
    if !first_ok
        || schema.len() > MAX_NAME
        || !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Err(SchemaError::InvalidName {
            schema: schema.to_owned(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_a_letter_then_letters_digits_and_underscores() {
        for good in [
            "inventory",
            "revenue",
            "orders2",
            "per_day_v2",
            &"a".repeat(MAX_NAME),
        ] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "2orders",
            "_hidden",
            "Revenue",
            "re-venue",
            "re\"venue",
            "revenue;drop",
            "r\u{e9}venue",
            &"a".repeat(MAX_NAME + 1),
        ] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }
}

//! The replication slot and what reading the WAL needs from PostgreSQL: the settings, the role's
//! privilege, the publication and the slot's state and lag — read by `waybill-relay wal check`.

use pgwire_replication::{ReplicationClient, ReplicationConfig, TlsConfig};
use serde::Serialize;
use sqlx::ConnectOptions as _;
use sqlx::PgPool;
use sqlx::postgres::PgSslMode;

use super::tls::{Identity, Pem, TlsTarget, Verify};

/// The slot the WAL relay reads unless told otherwise.
pub const DEFAULT_SLOT: &str = "waybill_outbox";
/// The publication migration 0005 creates.
pub const DEFAULT_PUBLICATION: &str = "waybill_outbox";

/// Refuses a slot or publication name PostgreSQL would need quoted: `START_REPLICATION` takes the slot
/// unquoted, so only lower-case letters, digits and `_` (at most 63, not starting with a digit) are
/// accepted — `pg_create_logical_replication_slot` takes `1abc`, which `START_REPLICATION` then
/// cannot parse.
pub fn check_name(what: &str, name: &str) -> Result<(), ops::Refused> {
    let fine = name.len() <= 63
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b == b'_')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if fine {
        Ok(())
    } else {
        Err(ops::Refused::new(format!(
            "{what} name {name:?}: use 1 to 63 lower-case letters, digits and _, starting with a letter or _"
        )))
    }
}

/// A replication session's settings and, where `sslmode` asks for TLS, the session it goes through.
#[derive(Debug)]
pub struct Replication {
    pub config: ReplicationConfig,
    pub tls: Option<TlsTarget>,
}

impl Replication {
    /// Opens the session (through its TLS bridge, if it has one) and starts streaming.
    pub async fn connect(self) -> anyhow::Result<ReplicationClient> {
        Ok(ReplicationClient::connect(self.bridged().await?).await?)
    }

    /// Opens the session without streaming: for commands such as `IDENTIFY_SYSTEM`.
    pub async fn connect_gated(self) -> anyhow::Result<ReplicationClient> {
        Ok(ReplicationClient::connect_gated(self.bridged().await?).await?)
    }

    async fn bridged(self) -> anyhow::Result<ReplicationConfig> {
        let mut config = self.config;
        if let Some(tls) = &self.tls {
            // The client reaches the bridge's socket at `<host>/.s.PGSQL.<port>`.
            config.host = tls.open_bridge().await?.display().to_string();
        }
        Ok(config)
    }
}

/// A replication session's settings from the relay's `DATABASE_URL`, read as the relay's other
/// sessions read it. `sslmode=require`, `verify-ca` and `verify-full` get TLS checked as for those
/// sessions (`sslrootcert`, or the public authorities), and present the client certificate of
/// `sslcert` and `sslkey` when the URL names one; `prefer` does too when there is a certificate
/// to present, and otherwise stays in plain text with `allow`, as before.
pub fn replication_config(
    database_url: &str,
    slot: &str,
    publication: &str,
) -> Result<Replication, ops::Refused> {
    let url = url::Url::parse(database_url)
        .map_err(|e| ops::Refused::new(format!("the database URL does not parse: {e}")))?;
    // The server, user, database and TLS as the relay's other sessions read them (sqlx's reading of
    // the URL and the PG* variables, `ops::database::connect_options`): the replication session
    // must reach the same server the same way.
    let options = ops::database::connect_options(database_url)
        .map_err(|e| ops::Refused::new(format!("the database URL cannot be read: {e}")))?;
    let user = options.get_username().to_owned();
    let database = options
        .get_database()
        .map_or_else(|| user.clone(), str::to_owned);
    // The replication client speaks TCP only: where the other sessions use a Unix socket (a
    // `host=/var/run/postgresql` parameter, or a percent-encoded socket path as the URL's host),
    // the server is on this machine and is reached over TCP at the same port — which pg_hba.conf's
    // `host` lines must then allow — rather than taken for a host name that cannot resolve.
    let host = if options.get_socket().is_some() {
        "localhost".to_owned()
    } else {
        options.get_host().to_owned()
    };
    let port = options.get_port();
    // sqlx has no getter for the password: the last `password=` parameter wins over the URL's, as
    // in sqlx's own reading.
    let password = match url
        .query_pairs()
        .filter(|(key, _)| key == "password")
        .last()
    {
        Some((_, password)) => password.into_owned(),
        None => url
            .password()
            .map(percent_decode)
            .transpose()
            .map_err(|_| ops::Refused::new("the database URL's password is not UTF-8"))?
            .unwrap_or_default(),
    };
    // sqlx keeps its certificate settings private; its URL of the options shows them, a file as
    // `file: <path>`, PEM text (from `PGSSLCERT` and the like) as itself.
    let settings = options.to_url_lossy();
    let pem = |key: &str| {
        settings
            .query_pairs()
            .find(|(k, _)| k == key)
            .map(|(_, value)| match value.strip_prefix("file: ") {
                Some(path) => Pem::File(path.into()),
                None => Pem::Text(value.into_owned()),
            })
    };
    let identity = match (pem("sslcert"), pem("sslkey")) {
        (None, None) => None,
        (Some(certificate), Some(key)) => Some(Identity { certificate, key }),
        // sqlx would connect without a certificate; a server that asks for one refuses that with
        // less to go on.
        _ => {
            return Err(ops::Refused::new(
                "sslcert and sslkey go together: the client certificate needs its key, and the \
                 key its certificate",
            ));
        }
    };
    let verify = match options.get_ssl_mode() {
        PgSslMode::Require => Some(Verify::Nothing),
        PgSslMode::VerifyCa => Some(Verify::Authority),
        PgSslMode::VerifyFull => Some(Verify::AuthorityAndName),
        // The pool, under `prefer`, takes the TLS a server offers and presents the certificate in
        // it: a server that asks for one gets it. The replication session does the same, as under
        // `require` (it fails on a server without TLS, where the pool would go on in plain text).
        PgSslMode::Prefer if identity.is_some() => Some(Verify::Nothing),
        // Plain text, as the pool may be: prefer and allow promise no encryption.
        PgSslMode::Disable | PgSslMode::Allow | PgSslMode::Prefer => None,
    };
    let tls = verify.map(|verify| TlsTarget {
        host: host.clone(),
        port,
        verify,
        roots: pem("sslrootcert"),
        identity,
    });
    let config = ReplicationConfig::new(host, user, password, database, slot, publication)
        .with_port(port)
        .with_tls(TlsConfig::disabled())
        // pgoutput writes each value in the session's text format: `created_at` must come as ISO
        // whatever DateStyle the database or the role sets.
        .with_options("-c datestyle=ISO");
    Ok(Replication { config, tls })
}

fn percent_decode(text: &str) -> Result<String, std::str::Utf8Error> {
    percent_encoding::percent_decode_str(text)
        .decode_utf8()
        .map(|s| s.into_owned())
}

/// The slot as `pg_replication_slots` shows it, with its lag.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct SlotState {
    pub name: String,
    pub plugin: Option<String>,
    /// The slot's database (a logical slot belongs to one).
    pub database: Option<String>,
    /// It belongs to the database the relay uses: slot names are shared by the whole server, and a
    /// relay of another database cannot read this one's.
    pub in_this_database: bool,
    /// A session reads it now.
    pub active: bool,
    pub active_pid: Option<i32>,
    /// `reserved`, `extended`, `unreserved` or `lost` (invalidated: it can never be read again).
    pub wal_status: Option<String>,
    /// WAL written since the position the reader confirmed, bytes.
    pub lag_bytes: Option<i64>,
    /// Seconds from writing WAL to its reader confirming it, as PostgreSQL last measured it for the
    /// reading session (`pg_stat_replication.replay_lag`); `None` without a reader, once the reader
    /// has caught up and the outbox is quiet, or for a role that may not see other sessions' stats.
    pub lag_seconds: Option<f64>,
    /// WAL the slot keeps on disk, bytes.
    pub retained_bytes: Option<i64>,
    /// Bytes that may still be written before the slot risks being invalidated; `None` without a
    /// `max_slot_wal_keep_size`.
    pub safe_wal_size: Option<i64>,
    /// The server's `max_slot_wal_keep_size` in bytes; `None` when it is unlimited (-1).
    pub keep_bytes: Option<i64>,
}

/// The share of `max_slot_wal_keep_size` left below which a slot is reported as close to
/// invalidation: early enough to restart a reader or drop the slot before PostgreSQL invalidates it.
pub const NEAR_INVALIDATION: f64 = 0.5;

impl SlotState {
    /// WAL that may still be written before PostgreSQL may invalidate the slot, when that is less
    /// than [`NEAR_INVALIDATION`] of `max_slot_wal_keep_size` and the slot is not past it yet.
    pub fn near_invalidation(&self) -> Option<i64> {
        let (safe, keep) = (self.safe_wal_size?, self.keep_bytes?);
        let reserved = matches!(self.wal_status.as_deref(), Some("reserved" | "extended"));
        (reserved && (safe as f64) < keep as f64 * NEAR_INVALIDATION).then_some(safe)
    }
}

/// A slot's row of `pg_replication_slots` as [`SlotState`] reads it, with its lag; callers add the
/// condition.
const SLOT_STATE: &str = "SELECT slot_name::text AS name, plugin::text, database::text,
        database IS NOT DISTINCT FROM current_database() AS in_this_database, active,
        active_pid, wal_status,
        pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::int8 AS lag_bytes,
        (SELECT extract(epoch FROM r.replay_lag)::float8 FROM pg_stat_replication r
         WHERE r.pid = s.active_pid) AS lag_seconds,
        pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8 AS retained_bytes,
        safe_wal_size,
        NULLIF(pg_size_bytes(current_setting('max_slot_wal_keep_size')), -1) AS keep_bytes
    FROM pg_replication_slots s";

/// Every logical slot of this database (what `status` shows).
pub async fn database_slots(pool: &PgPool) -> sqlx::Result<Vec<SlotState>> {
    sqlx::query_as(
        sqlx::AssertSqlSafe(format!(
        "{SLOT_STATE} WHERE slot_type = 'logical' AND database = current_database() ORDER BY slot_name"
    )))
    .fetch_all(pool)
    .await
}

/// Reads slot `name`, or `None` when there is none.
pub async fn slot_state(pool: &PgPool, name: &str) -> sqlx::Result<Option<SlotState>> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "{SLOT_STATE} WHERE slot_name = $1"
    )))
    .bind(name)
    .fetch_optional(pool)
    .await
}

/// Creates logical slot `name` for pgoutput; `false` when it exists already (perhaps made by another
/// relay a moment ago).
pub async fn create_slot(pool: &PgPool, name: &str) -> sqlx::Result<bool> {
    let created = sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(name)
        .execute(pool)
        .await;
    match created {
        Ok(_) => Ok(true),
        Err(error)
            if error
                .as_database_error()
                .and_then(|e| e.code())
                .is_some_and(|code| code == "42710") =>
        {
            Ok(false)
        }
        Err(error) => Err(error),
    }
}

/// Drops slot `name` (one no session reads); `false` when there was none.
pub async fn drop_slot(pool: &PgPool, name: &str) -> sqlx::Result<bool> {
    let dropped = sqlx::query(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(name)
    .execute(pool)
    .await?;
    Ok(dropped.rows_affected() > 0)
}

/// The server's WAL insert position now (past every commit record made so far, written out or not:
/// with `synchronous_commit = off` a commit is visible before its record is written), as a number.
pub async fn current_position(pool: &PgPool) -> sqlx::Result<u64> {
    let position: i64 =
        sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::int8")
            .fetch_one(pool)
            .await?;
    Ok(u64::try_from(position).unwrap_or_default())
}

/// The schema where the relay's `outbox` resolves (the pool's search path): only that table's
/// inserts are its rows, whatever else the publication lists.
pub async fn outbox_schema(pool: &PgPool) -> anyhow::Result<String> {
    let schema: Option<String> = sqlx::query_scalar(
        "SELECT n.nspname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.oid = to_regclass($1)",
    )
    .bind(store::outbox::TABLE)
    .fetch_optional(pool)
    .await?;
    schema.ok_or_else(|| {
        anyhow::anyhow!(
            "no {} table on the search path: run `waybill migrate`",
            store::outbox::TABLE
        )
    })
}

/// Publication `name` exists.
pub async fn publication_exists(pool: &PgPool, name: &str) -> sqlx::Result<bool> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
        .bind(name)
        .fetch_one(pool)
        .await
}

/// Where slot `name`'s reader last confirmed, as a WAL position.
pub async fn confirmed_position(pool: &PgPool, name: &str) -> sqlx::Result<Option<u64>> {
    let position: Option<Option<i64>> = sqlx::query_scalar(
        "SELECT pg_wal_lsn_diff(confirmed_flush_lsn, '0/0')::int8 FROM pg_replication_slots
         WHERE slot_name = $1",
    )
    .bind(name)
    .fetch_optional(pool)
    .await?;
    Ok(position.flatten().and_then(|p| u64::try_from(p).ok()))
}

/// One prerequisite of `--source wal`, checked.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// What was checked, e.g. `wal_level`.
    pub check: &'static str,
    /// `ok`, `warn` (works, but an operator should know) or `missing` (the WAL relay cannot run).
    pub verdict: Verdict,
    /// What was found, and when not ok, what to do.
    pub detail: String,
}

/// How a prerequisite stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Ok,
    Warn,
    Missing,
}

/// Everything `--source wal` needs, one finding each, read-only: the server's settings, the role's
/// privilege, the publication, the slot (when there is one) and, with `round_trip`, a replication
/// session's round trip.
pub async fn check(
    pool: &PgPool,
    database_url: &str,
    slot: &str,
    publication: &str,
    round_trip: bool,
) -> anyhow::Result<Vec<Finding>> {
    let mut findings = Vec::new();
    let mut say = |check, verdict, detail: String| {
        findings.push(Finding {
            check,
            verdict,
            detail,
        })
    };
    let setting = |name: &'static str| async move {
        sqlx::query_scalar::<_, String>("SELECT current_setting($1)")
            .bind(name)
            .fetch_one(pool)
            .await
    };

    let wal_level = setting("wal_level").await?;
    if wal_level == "logical" {
        say("wal_level", Verdict::Ok, "logical".to_owned());
    } else {
        say(
            "wal_level",
            Verdict::Missing,
            format!(
                "{wal_level}: set wal_level = logical (ALTER SYSTEM SET wal_level = logical) and \
                 restart PostgreSQL"
            ),
        );
    }

    let (slots_used, slots_max, senders_max): (i64, i32, i32) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM pg_replication_slots),
                current_setting('max_replication_slots')::int4,
                current_setting('max_wal_senders')::int4",
    )
    .fetch_one(pool)
    .await?;
    let own_slot = slot_state(pool, slot).await?;
    if own_slot.is_some() || slots_used < i64::from(slots_max) {
        say(
            "max_replication_slots",
            Verdict::Ok,
            format!("{slots_used} of {slots_max} in use"),
        );
    } else {
        say(
            "max_replication_slots",
            Verdict::Missing,
            format!("all {slots_max} in use: raise max_replication_slots (restart)"),
        );
    }
    if senders_max > 0 {
        say(
            "max_wal_senders",
            Verdict::Ok,
            format!("{senders_max} (one reader and one standby need 2)"),
        );
    } else {
        say(
            "max_wal_senders",
            Verdict::Missing,
            "0: set max_wal_senders (restart)".to_owned(),
        );
    }

    let (role, may_replicate): (String, bool) = sqlx::query_as(
        // Amazon RDS and Aurora grant it through membership of rds_replication instead.
        "SELECT current_user::text, rolreplication OR rolsuper
                OR EXISTS (SELECT 1 FROM pg_roles r WHERE r.rolname = 'rds_replication'
                           AND pg_has_role(current_user, r.oid, 'MEMBER'))
         FROM pg_roles WHERE rolname = current_user",
    )
    .fetch_one(pool)
    .await?;
    if may_replicate {
        say("replication privilege", Verdict::Ok, format!("role {role}"));
    } else {
        say(
            "replication privilege",
            Verdict::Missing,
            format!("role {role} lacks it: as a superuser, ALTER ROLE {role} REPLICATION"),
        );
    }

    // A row filter or a column list (PostgreSQL 15) would keep rows or columns from the relay: read
    // through to_jsonb, so that older servers without those columns read as having neither.
    let published: Option<(bool, Option<String>, Vec<String>)> = sqlx::query_as(
        "SELECT p.pubinsert AND t.pubname IS NOT NULL,
                to_jsonb(t) ->> 'rowfilter',
                COALESCE((SELECT array_agg(c ORDER BY c) FROM unnest($3::text[]) AS c
                          WHERE NOT (to_jsonb(t) -> 'attnames') ? c), '{}')
         FROM pg_publication p
         LEFT JOIN pg_publication_tables t
           ON t.pubname = p.pubname
          AND format('%I.%I', t.schemaname, t.tablename)::regclass = to_regclass($2)
         WHERE p.pubname = $1",
    )
    .bind(publication)
    .bind(store::outbox::TABLE)
    // The relay's table is the one its search path finds (as it reads it), and the columns that
    // matter are those it reads.
    .bind(&super::pgoutput::COLUMNS_READ[..])
    .fetch_optional(pool)
    .await?;
    let whole_table = format!(
        "ALTER PUBLICATION {publication} SET TABLE {}",
        store::outbox::TABLE
    );
    match published {
        Some((true, Some(filter), _)) => say(
            "publication",
            Verdict::Missing,
            format!(
                "{publication} filters the outbox's rows (WHERE {filter}): rows it leaves out \
                 would wait for the next session's drain; {whole_table}"
            ),
        ),
        Some((true, None, left_out)) if !left_out.is_empty() => say(
            "publication",
            Verdict::Missing,
            format!(
                "{publication} leaves out the outbox's columns {}: {whole_table}",
                left_out.join(", ")
            ),
        ),
        Some((true, None, _)) => say(
            "publication",
            Verdict::Ok,
            format!("{publication} publishes the outbox's inserts"),
        ),
        Some((false, _, _)) => say(
            "publication",
            Verdict::Missing,
            format!(
                "{publication} exists but does not publish inserts into the outbox: \
                 ALTER PUBLICATION {publication} SET TABLE {table}, SET (publish = 'insert')",
                table = store::outbox::TABLE
            ),
        ),
        None => say(
            "publication",
            Verdict::Missing,
            format!(
                "{publication} does not exist: as the database's owner, CREATE PUBLICATION \
                 {publication} FOR TABLE {table} WITH (publish = 'insert')",
                table = store::outbox::TABLE
            ),
        ),
    }

    let keep: String = setting("max_slot_wal_keep_size").await?;
    match &own_slot {
        None => say(
            "slot",
            Verdict::Ok,
            format!("{slot} does not exist yet: the WAL relay creates it on its first start"),
        ),
        Some(state) => {
            let (verdict, detail) = describe_slot(state, &keep);
            say("slot", verdict, detail);
        }
    }
    if keep == "-1" {
        say(
            "max_slot_wal_keep_size",
            Verdict::Warn,
            "-1 (no limit): a slot whose reader is gone keeps WAL until the disk is full; set a \
             limit larger than the WAL of the longest outage you will ride out"
                .to_owned(),
        );
    } else {
        say("max_slot_wal_keep_size", Verdict::Ok, keep.clone());
    }

    // The last word: a replication session opens (pg_hba, the privilege and the database as the
    // server sees them) and identifies the server.
    if !round_trip {
        return Ok(findings);
    }
    match replication_config(database_url, slot, publication) {
        Err(refused) => say(
            "replication connection",
            Verdict::Missing,
            refused.to_string(),
        ),
        Ok(config) => match identify(config).await {
            Ok(detail) => say("replication connection", Verdict::Ok, detail),
            Err(error) => say(
                "replication connection",
                Verdict::Missing,
                format!("{error} (pg_hba.conf must let this role connect to this database)"),
            ),
        },
    }
    Ok(findings)
}

/// Fails where [`check`] finds a prerequisite missing: every session would fail the same way,
/// slowly, with the outbox left to their opening drains. Not for what the relay mends itself (a
/// lost slot, dropped and made again), nor the replication round trip, which a standby may not get
/// while the reader holds the last WAL sender.
pub async fn refuse_what_is_missing(
    pool: &PgPool,
    database_url: &str,
    slot: &str,
    publication: &str,
) -> anyhow::Result<()> {
    let findings = check(pool, database_url, slot, publication, false).await?;
    let lost = slot_state(pool, slot)
        .await?
        .is_some_and(|s| s.in_this_database && s.wal_status.as_deref() == Some("lost"));
    let missing: Vec<String> = findings
        .into_iter()
        .filter(|f| f.verdict == Verdict::Missing && !(lost && f.check == "slot"))
        .map(|f| format!("{}: {}", f.check, f.detail))
        .collect();
    anyhow::ensure!(
        missing.is_empty(),
        "--source wal cannot run on this database (`waybill-relay wal check` lists the same):\n  {}",
        missing.join("\n  ")
    );
    Ok(())
}

/// The slot's verdict and a line about it: lost is fatal, unreserved (past `keep`, the server's
/// `max_slot_wal_keep_size`) a warning, and so is a slot with less than half of it left.
pub fn describe_slot(state: &SlotState, keep: &str) -> (Verdict, String) {
    let mb =
        |bytes: Option<i64>| bytes.map_or("-".to_owned(), |b| format!("{:.1} MB", b as f64 / 1e6));
    let reader = match state.active_pid {
        Some(pid) if state.active => format!("read by pid {pid}"),
        _ => "no reader".to_owned(),
    };
    let seconds = state
        .lag_seconds
        .map_or(String::new(), |s| format!(" ({s:.1} s)"));
    let detail = format!(
        "{}: {}, {reader}, {}{seconds} behind, {} retained, wal_status {}, plugin {}",
        state.name,
        state.database.as_deref().unwrap_or("no database"),
        mb(state.lag_bytes),
        mb(state.retained_bytes),
        state.wal_status.as_deref().unwrap_or("-"),
        state.plugin.as_deref().unwrap_or("-"),
    );
    if !state.in_this_database {
        return (
            Verdict::Missing,
            format!(
                "{detail}: not a slot of this database — slot names are shared by the whole server; \
                 give this database's relays a slot of their own (--slot)"
            ),
        );
    }
    match state.wal_status.as_deref() {
        Some("lost") => (
            Verdict::Missing,
            format!(
                "{detail}: invalidated, it can never be read again; drop it (the polling relay delivers meanwhile)"
            ),
        ),
        Some("unreserved") => (
            Verdict::Warn,
            format!("{detail}: past max_slot_wal_keep_size ({keep}), about to be invalidated"),
        ),
        _ if state.plugin.as_deref() != Some("pgoutput") => (
            Verdict::Missing,
            format!("{detail}: not a pgoutput slot; drop it or name another with --slot"),
        ),
        _ if state.near_invalidation().is_some() => (
            Verdict::Warn,
            format!(
                "{detail}: {} of WAL left before max_slot_wal_keep_size ({keep}) lets PostgreSQL invalidate it; \
                 start its reader or drop the slot",
                mb(state.safe_wal_size)
            ),
        ),
        _ => (Verdict::Ok, detail),
    }
}

/// Opens a replication session, identifies the server and closes it.
async fn identify(replication: Replication) -> anyhow::Result<String> {
    let mut client = replication.connect_gated().await?;
    let identified =
        tokio::time::timeout(std::time::Duration::from_secs(10), client.identify_system())
            .await
            .map_err(|_| anyhow::anyhow!("no answer within 10 s"))?;
    client.abort();
    let system = identified?;
    Ok(format!(
        "system {}, timeline {}, WAL at {}, database {}",
        system.system_id,
        system.timeline,
        system.xlogpos,
        system.dbname.as_deref().unwrap_or("-")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_need_quoting_are_refused() {
        assert!(check_name("slot", "waybill_outbox").is_ok());
        assert!(check_name("slot", "_2nd_outbox").is_ok());
        for bad in [
            "",
            "Outbox",
            "a-b",
            "x; DROP",
            &"a".repeat(64),
            "ü",
            "1abc",
            "9x",
        ] {
            assert!(check_name("slot", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_replication_session_reaches_the_server_the_pool_reaches() {
        let target = |url: &str| {
            let config = replication_config(url, "s", "p").expect("a config").config;
            (config.host, config.port)
        };
        let this_machine = |port| ("localhost".to_owned(), port);
        // sqlx uses the socket, whatever the URL's host says: the server is on this machine.
        assert_eq!(
            target("postgres://relay@127.0.0.1:6543/shop?sslmode=disable&host=/var/run/postgresql"),
            this_machine(6543)
        );
        assert_eq!(target("postgres:///shop?host=/tmp"), this_machine(5432));
        assert_eq!(
            target("postgres://u@db.example/shop?host=/var/run/postgresql"),
            this_machine(5432)
        );
        // The socket's port, and the percent-encoded form sqlx also reads.
        assert_eq!(
            target("postgres:///shop?host=/var/run/postgresql&port=5433"),
            this_machine(5433)
        );
        assert_eq!(
            target("postgres://%2Fvar%2Frun%2Fpostgresql:5434/shop"),
            this_machine(5434)
        );
        // A later TCP host wins over an earlier one, as in sqlx.
        assert_eq!(
            target("postgres://relay@127.0.0.1/shop?host=db.local").0,
            "db.local"
        );
        assert_eq!(
            target("postgres://u@db.example/shop?hostaddr=10.0.0.5").0,
            "10.0.0.5"
        );
        // User, password and database given as parameters win over the URL's, as in sqlx.
        let config = replication_config(
            "postgres://a:p1@localhost/one?user=relay&password=p%202&dbname=shop",
            "s",
            "p",
        )
        .expect("a config")
        .config;
        assert_eq!(
            (
                config.user.as_str(),
                config.password.as_str(),
                config.database.as_str()
            ),
            ("relay", "p 2", "shop")
        );
        let config = replication_config("postgres://relay:p%40ss@localhost/shop", "s", "p")
            .expect("a config")
            .config;
        assert_eq!(
            (config.user.as_str(), config.password.as_str()),
            ("relay", "p@ss")
        );
    }

    #[test]
    fn a_url_asking_for_tls_gets_it_checked_as_the_pool_checks_it() {
        let tls = |url: &str| replication_config(url, "s", "p").expect("a config").tls;
        let target = |verify, roots| {
            Some(TlsTarget {
                host: "db".to_owned(),
                port: 5433,
                verify,
                roots,
                identity: None,
            })
        };
        assert_eq!(
            tls("postgres://relay:pw@db:5433/shop?sslmode=require"),
            target(Verify::Nothing, None)
        );
        assert_eq!(
            tls("postgres://relay:pw@db:5433/shop?sslmode=verify-ca&sslrootcert=/etc/ca.pem"),
            target(Verify::Authority, Some(Pem::File("/etc/ca.pem".into())))
        );
        assert_eq!(
            tls("postgres://relay:pw@db:5433/shop?ssl-mode=verify-full"),
            target(Verify::AuthorityAndName, None)
        );
        // Plain text where the pool may be, as before: prefer and allow promise no encryption.
        for mode in ["disable", "allow", "prefer"] {
            assert_eq!(
                tls(&format!("postgres://relay@db/shop?sslmode={mode}")),
                None
            );
        }
        // A client certificate is presented with its key; one without the other is refused.
        assert_eq!(
            tls("postgres://relay@db/shop?sslmode=verify-full&sslcert=/c.pem&sslkey=/k.pem")
                .and_then(|target| target.identity),
            Some(Identity {
                certificate: Pem::File("/c.pem".into()),
                key: Pem::File("/k.pem".into()),
            })
        );
        // Under prefer (sqlx's default) the pool presents it in the TLS the server offers: so does
        // the replication session, rather than stay in plain text where a certificate is asked for.
        assert_eq!(
            tls("postgres://relay@db/shop?sslcert=/c.pem&sslkey=/k.pem")
                .map(|target| (target.verify, target.identity.is_some())),
            Some((Verify::Nothing, true))
        );
        for half in ["sslcert=/c.pem", "sslkey=/k.pem"] {
            let refused = replication_config(
                &format!("postgres://relay@db/shop?sslmode=require&{half}"),
                "s",
                "p",
            )
            .expect_err("refused")
            .to_string();
            assert!(refused.contains("go together"), "{refused}");
        }
    }

    #[test]
    fn a_slot_that_is_lost_or_not_pgoutput_is_reported() {
        let state = |wal_status: &str, plugin: &str| SlotState {
            name: "s".into(),
            plugin: Some(plugin.into()),
            database: Some("shop".into()),
            in_this_database: true,
            active: false,
            active_pid: None,
            wal_status: Some(wal_status.into()),
            lag_bytes: Some(2_000_000),
            lag_seconds: None,
            retained_bytes: Some(3_000_000),
            safe_wal_size: None,
            keep_bytes: None,
        };
        assert_eq!(
            describe_slot(&state("reserved", "pgoutput"), "-1").0,
            Verdict::Ok
        );
        assert_eq!(
            describe_slot(&state("unreserved", "pgoutput"), "1GB").0,
            Verdict::Warn
        );
        assert_eq!(
            describe_slot(&state("lost", "pgoutput"), "1GB").0,
            Verdict::Missing
        );
        // Less than half of max_slot_wal_keep_size left: warned before PostgreSQL acts.
        let limited = |safe: i64| SlotState {
            safe_wal_size: Some(safe),
            keep_bytes: Some(1_000_000_000),
            ..state("reserved", "pgoutput")
        };
        let (verdict, detail) = describe_slot(&limited(200_000_000), "1GB");
        assert_eq!(verdict, Verdict::Warn, "{detail}");
        assert!(detail.contains("200.0 MB of WAL left"), "{detail}");
        assert_eq!(describe_slot(&limited(600_000_000), "1GB").0, Verdict::Ok);
        assert_eq!(limited(200_000_000).near_invalidation(), Some(200_000_000));
        assert_eq!(state("reserved", "pgoutput").near_invalidation(), None);
        assert_eq!(
            describe_slot(&state("reserved", "test_decoding"), "-1").0,
            Verdict::Missing
        );
        let elsewhere = SlotState {
            database: Some("alpha".into()),
            in_this_database: false,
            ..state("reserved", "pgoutput")
        };
        let (verdict, detail) = describe_slot(&elsewhere, "-1");
        assert_eq!(verdict, Verdict::Missing);
        assert!(detail.contains("not a slot of this database"), "{detail}");
        assert!(
            describe_slot(&state("reserved", "pgoutput"), "-1")
                .1
                .contains("2.0 MB behind")
        );
    }
}

//! Login roles for the tests that prove the least-privilege group roles (`waybill roles create`): a
//! login member of one group, its URL to hand to a binary, and a connection as it.

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

/// A login user of the test server, member of one group role; [`Login::drop`] removes it.
#[derive(Debug)]
pub struct Login {
    /// The role's name (unique per call, so parallel tests never share one).
    pub name: String,
    /// The test database's URL as this user.
    pub url: String,
    /// One connection as that user.
    pub pool: PgPool,
}

impl Login {
    /// A login user in `group`, on the server and database of `pool`, and a connection as it.
    pub async fn create(pool: &PgPool, group: &str) -> Self {
        let name = format!("wb_test_{}", Uuid::now_v7().simple());
        let sql = format!("CREATE ROLE {name} LOGIN PASSWORD 'pw' IN ROLE {group}");
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(pool)
            .await
            .expect("create login");
        let url = crate::database_url(pool).await;
        // The test server trusts local connections; the user name is what matters for privileges.
        let (scheme_rest, database) = url.rsplit_once('/').expect("url with database");
        let host = scheme_rest
            .rsplit_once('@')
            .map_or(scheme_rest.trim_start_matches("postgres://"), |(_, h)| h);
        let url = format!("postgres://{name}@{host}/{database}");
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect(&url)
            .await
            .expect("log in");
        Self { name, url, pool }
    }

    /// Closes the connection and drops the user (and whatever it owns) through `admin`.
    pub async fn drop(self, admin: &PgPool) {
        self.pool.close().await;
        let database: String = sqlx::query_scalar("SELECT current_database()")
            .fetch_one(admin)
            .await
            .expect("db");
        let name = &self.name;
        for sql in [
            format!("REVOKE ALL ON DATABASE \"{database}\" FROM {name}"),
            format!("DROP OWNED BY {name}"),
            format!("DROP ROLE {name}"),
        ] {
            let _ = sqlx::query(sqlx::AssertSqlSafe(sql)).execute(admin).await;
        }
    }
}

/// Whether `sql` is refused for want of a privilege (SQLSTATE 42501).
pub async fn denied(pool: &PgPool, sql: &'static str) -> bool {
    match sqlx::query(sql).execute(pool).await {
        Ok(_) => false,
        Err(error) => ops::database::has_sqlstate(&error, "42501"),
    }
}

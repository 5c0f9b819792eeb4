//! The command line and read API every [`ReadModel`] gets: the runner's commands (`run`, `rebuild`,
//! `redrive`, `parked …`, `held …`) plus `show` (the read model as JSON), `expect` (what it must be,
//! folded from the event store) and `check` (the two compared), and `GET /state` on `--listen`.

use std::process::ExitCode;

use axum::Json;
use axum::extract::State;
use axum::routing::get;
use clap::Subcommand;
use serde_json::Value;
use sqlx::PgPool;

use crate::kit::{BoxFuture, Kit, Model, ReadModel};

/// The read commands of a model.
#[derive(Debug, Subcommand)]
pub enum ModelRead {
    /// Print the read model as one JSON document.
    Show,
    /// Print what the read model must be: the model's own pure fold of the event store's events.
    Expect,
    /// Compare the two: exit 0 when they are equal, 1 naming where they differ.
    Check,
}

/// Runs model `M`'s command line on `args` (the program's name first).
pub async fn model_main<M: ReadModel + Clone>(model: M, args: Vec<String>) -> ExitCode {
    let routes_model = model.clone();
    let read_model = model.clone();
    crate::cli::main_from(
        args.into_iter().map(Into::into).collect(),
        format!("waybill-projection {}", M::NAME),
        Kit(model),
        M::ABOUT,
        move |pool| routes(routes_model, pool),
        async move |command, pool, _json| {
            let document = match command {
                ModelRead::Show => read_model.read(&pool).await?,
                ModelRead::Expect => expected(&read_model, &pool).await?,
                ModelRead::Check => {
                    let (actual, expected) =
                        (read_model.read(&pool).await?, expected(&read_model, &pool).await?);
                    if let Some(difference) = first_difference(&expected, &actual, "") {
                        println!(
                            "{}",
                            serde_json::json!({"equal": false, "difference": difference})
                        );
                        return Err(ops::AlreadyReported(format!(
                            "the {} read model differs from the fold of the event store: {difference}",
                            M::NAME
                        ))
                        .into());
                    }
                    serde_json::json!({"equal": true})
                }
            };
            println!("{}", serde_json::to_string_pretty(&document)?);
            Ok(())
        },
    )
    .await
}

/// `GET /state`: the read model as one JSON document.
fn routes<M: ReadModel + Clone>(model: M, pool: PgPool) -> axum::Router {
    axum::Router::new()
        .route(
            "/state",
            get(async move |State(pool): State<PgPool>| {
                model
                    .read(&pool)
                    .await
                    .map(Json)
                    .map_err(|error| crate::http::Problem::unavailable("reading the model", &error))
            }),
        )
        .with_state(pool)
}

/// The model's fold of every event of its aggregate types in the store (the database of `pool`,
/// whose search path reaches `events`).
pub(crate) async fn expected<M: ReadModel>(model: &M, pool: &PgPool) -> anyhow::Result<Value> {
    let events = crate::history::store_events::<M::Event>(pool, M::AGGREGATES).await?;
    Ok(model.expected(&events))
}

/// Where `actual` first differs from `expected` (a JSON path and both values), or `None`.
pub fn first_difference(expected: &Value, actual: &Value, path: &str) -> Option<String> {
    match (expected, actual) {
        (Value::Object(e), Value::Object(a)) => {
            for key in e.keys().chain(a.keys()) {
                let here = format!("{path}.{key}");
                let (ev, av) = (
                    e.get(key).unwrap_or(&Value::Null),
                    a.get(key).unwrap_or(&Value::Null),
                );
                if let Some(found) = first_difference(ev, av, &here) {
                    return Some(found);
                }
            }
            None
        }
        (Value::Array(e), Value::Array(a)) => {
            for (i, (ev, av)) in e.iter().zip(a).enumerate() {
                if let Some(found) = first_difference(ev, av, &format!("{path}[{i}]")) {
                    return Some(found);
                }
            }
            (e.len() != a.len()).then(|| {
                format!(
                    "{} has {} entries in the fold, {} in the read model",
                    if path.is_empty() { "." } else { path },
                    e.len(),
                    a.len()
                )
            })
        }
        (e, a) if e == a => None,
        (e, a) => Some(format!(
            "{}: the fold says {e}, the read model {a}",
            if path.is_empty() { "." } else { path }
        )),
    }
}

/// A registered model (what [`crate::register_model!`] makes).
#[derive(Debug)]
pub struct Entry<M>(pub M);

impl<M: ReadModel + Clone> Model for Entry<M> {
    fn name(&self) -> &'static str {
        M::NAME
    }

    fn about(&self) -> &'static str {
        M::ABOUT
    }

    fn aggregates(&self) -> &'static [&'static str] {
        M::AGGREGATES
    }

    fn tables(&self) -> &'static str {
        M::TABLES
    }

    fn main(&self, args: Vec<String>) -> BoxFuture<'static, std::process::ExitCode> {
        let model = self.0.clone();
        Box::pin(async move { crate::model_cli::model_main(model, args).await })
    }

    fn read<'a>(&'a self, database_url: &'a str) -> BoxFuture<'a, anyhow::Result<Value>> {
        Box::pin(async move {
            let pool = crate::schema::connect(database_url, M::NAME, M::TABLES).await?;
            let read = self.0.read(&pool).await;
            pool.close().await;
            Ok(read?)
        })
    }

    fn read_from<'a>(&'a self, pool: &'a PgPool) -> BoxFuture<'a, anyhow::Result<Value>> {
        Box::pin(async move {
            crate::schema::check_name(M::NAME)?;
            let options = (*pool.connect_options())
                .clone()
                .options([("search_path", format!("{},public", M::NAME))]);
            let reader = ops::database::pool_options(1).connect_with(options).await?;
            let read = self.0.read(&reader).await;
            reader.close().await;
            Ok(read?)
        })
    }

    fn expected<'a>(&'a self, database_url: &'a str) -> BoxFuture<'a, anyhow::Result<Value>> {
        Box::pin(async move {
            let pool = crate::schema::connect(database_url, M::NAME, M::TABLES).await?;
            let expected = crate::model_cli::expected(&self.0, &pool).await;
            pool.close().await;
            expected
        })
    }
}

/// Registers the model `$model` (a unit struct implementing [`ReadModel`] and `Clone`), at the
/// end of its file in `projections/src/models/`: the registry, the console, the demo and chaos then
/// know it, and `waybill-projection <name>` runs it.
#[macro_export]
macro_rules! register_model {
    ($model:ident) => {
        /// This file's model, as the registry holds it.
        pub static MODEL: $crate::model_cli::Entry<$model> = $crate::model_cli::Entry($model);
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_first_difference_is_named_by_its_path() {
        let expected = json!({"rows": [{"day": "2026-12-03", "paid": 5}], "n": 1});
        assert_eq!(first_difference(&expected, &expected.clone(), ""), None);
        let actual = json!({"rows": [{"day": "2026-12-03", "paid": 4}], "n": 1});
        assert_eq!(
            first_difference(&expected, &actual, "").as_deref(),
            Some(".rows[0].paid: the fold says 5, the read model 4")
        );
        let shorter = json!({"rows": [], "n": 1});
        assert!(
            first_difference(&expected, &shorter, "")
                .is_some_and(|d| d.contains("1 entries in the fold, 0"))
        );
    }
}

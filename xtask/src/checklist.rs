//! What is left after the scaffold, for any event type of any aggregate: each step names the file
//! and line it changes, found in the domain's source (`crate::source`), in the order of the guide
//! (`docs/guides/new-event-version.md`), which builds after every step.

use std::path::Path;

use domain::catalog::{RELEASED_FILE, fixture_file_name};

use crate::XtaskError;
use crate::source::{
    Location, Source, argument_type, const_named, declares_struct, module_path, pascal, snake,
};

/// The one command that checks a whole new version: every target of the workspace builds (the
/// tests and benches that build events included), the domain's tests pass (the fixtures, the
/// schemas, the upcasters), and the catalog's readers print it.
pub const CHECK: &str = "cargo build --workspace --all-targets && cargo test -p domain && cargo test -p waybill --test schema_tool";

/// The guide the checklist follows.
pub const GUIDE: &str = "docs/guides/new-event-version.md";

/// Where the code of `event_type` and its aggregate stands, as far as it could be found.
#[derive(Debug)]
pub struct Places {
    /// `OrderShipped`.
    pub payload: String,
    /// `Order`.
    pub aggregate: String,
    /// `OrderEvent::SHIPPED` (the enum's constant for the type name), when found.
    pub type_constant: Option<String>,
    /// `pub struct OrderShipped`.
    pub payload_at: Option<Location>,
    /// `fn from_command` in `impl OrderShipped`.
    pub constructor_at: Option<Location>,
    /// The command the constructor reads, and where it is declared.
    pub command: Option<(String, Option<Location>)>,
    /// The entry `(…::SHIPPED, <current>)` of `CURRENT_VERSIONS`.
    pub version_at: Option<Location>,
    /// `fn upcasters()` in `impl Aggregate for Order`.
    pub upcasters_at: Option<Location>,
    /// The first upcast step of the aggregate's events (`fn order_…_vN_to_vM`), if it has any.
    pub steps_at: Option<Location>,
    /// The title `"order.shipped v<current>"` of the current schema.
    pub schema_at: Option<Location>,
    /// Where value types are declared (`pub struct ValueError`'s file).
    pub values_at: Option<Location>,
}

impl Places {
    /// Finds `event_type` (of `aggregate_type`, at `current`) in `source`.
    pub fn find(source: &Source, aggregate_type: &str, event_type: &str, current: i32) -> Self {
        let payload = pascal(event_type);
        let aggregate = pascal(aggregate_type);
        let event_enum = format!("{aggregate}Event");
        let type_name = source
            .find(|l| const_named(l, event_type).is_some())
            .and_then(|at| const_named(source.line(&at)?, event_type));
        let payload_at = source.find(|l| declares_struct(l, &payload));
        let constructor_at = source
            .find(|l| l.trim_start() == format!("impl {payload} {{"))
            .and_then(|at| source.find_after(&at, |l| l.contains("fn from_command(")));
        let command = constructor_at
            .as_ref()
            .and_then(|at| argument_type(source.line(at)?))
            .map(|name| {
                let at = source.find(|l| declares_struct(l, &name));
                (name, at)
            });
        let version_at = type_name
            .as_ref()
            .and_then(|name| source.find(|l| l.contains(&format!("::{name}, {current})"))));
        let upcasters_at = source
            .find(|l| l.contains(&format!("Aggregate for {aggregate} {{")))
            .and_then(|at| source.find_after(&at, |l| l.contains("fn upcasters()")));
        let step_prefix = format!("fn {}_", snake(aggregate_type));
        let steps_at = source.find(|l| l.contains(&step_prefix) && l.contains("_to_v"));
        let schema_at = source.find(|l| l.contains(&format!("\"{event_type} v{current}\"")));
        let values_at = source.find(|l| declares_struct(l, "ValueError"));
        Self {
            payload,
            aggregate,
            type_constant: type_name.map(|name| format!("{event_enum}::{name}")),
            payload_at,
            constructor_at,
            command,
            version_at,
            upcasters_at,
            steps_at,
            schema_at,
            values_at,
        }
    }
}

/// `at`, or a note that the code did not show it.
fn at(location: &Option<Location>) -> String {
    location.as_ref().map_or_else(
        || "not found under domain/src".to_owned(),
        Location::to_string,
    )
}

/// The steps after the scaffold of `event_type` v`current + 1`, each naming its file and line in
/// `domain_dir`'s source (paths from the workspace root), and the README's row of the type.
pub fn steps(
    domain_dir: &Path,
    aggregate_type: &str,
    event_type: &str,
    current: i32,
) -> Result<Vec<String>, XtaskError> {
    let source = Source::read(domain_dir)?;
    let places = Places::find(&source, aggregate_type, event_type, current);
    let next = current + 1;
    let Places {
        payload, aggregate, ..
    } = &places;
    let constant = places
        .type_constant
        .clone()
        .unwrap_or_else(|| format!("\"{event_type}\""));
    let up = format!("{}_v{current}_to_v{next}", snake(event_type));
    let down = format!("{}_v{next}_to_v{current}", snake(event_type));
    // Steps live beside the aggregate's others; an aggregate without any keeps them beside its
    // `upcasters()`.
    let steps_at = places.steps_at.as_ref().or(places.upcasters_at.as_ref());
    let step_module = steps_at.map_or_else(|| "domain".to_owned(), |l| module_path(&l.file));
    let readme = domain_dir
        .parent()
        .map(|root| root.join("README.md"))
        .and_then(|path| std::fs::read_to_string(path).ok())
        .and_then(|text| {
            let row = format!("| `{event_type}` |");
            text.lines().position(|l| l.starts_with(&row))
        })
        .map_or_else(
            || "README.md (its payload table)".to_owned(),
            |line| format!("README.md:{}", line + 1),
        );
    let command = match &places.command {
        Some((name, declared)) => format!("{name} ({})", at(declared)),
        None => format!("the command {payload}::from_command reads"),
    };
    Ok(vec![
        format!(
            "The field, with a default: add v{next}'s fields to {payload} ({}) and set each in \
             {payload}::from_command ({}), from the command or a default; a new value type goes \
             beside the others ({}) and is re-exported from domain/src/lib.rs.",
            at(&places.payload_at),
            at(&places.constructor_at),
            places
                .values_at
                .as_ref()
                .map_or_else(|| "domain/src/values.rs".to_owned(), |l| l.file.clone()),
        ),
        format!(
            "The upcaster and the version: write {up} (what every older event gets for each new \
             field) and the downcaster {down} (refusing what v{current} cannot carry) beside {} \
             ({}); register both in {aggregate}::upcasters() ({}) with \
             .with_named_step({constant}, {current}, \"{step_module}::{up}\", {up}) and \
             .with_downcast({constant}, {next}, {down}); then bump {event_type} from {current} to \
             {next} in CURRENT_VERSIONS ({}).",
            if places.steps_at.is_some() {
                "the aggregate's other steps"
            } else {
                "the registry"
            },
            at(&steps_at.cloned()),
            at(&places.upcasters_at),
            at(&places.version_at),
        ),
        format!(
            "The schema: add the {event_type} v{next} schema (title \"{event_type} v{next}\") beside \
             v{current}'s ({}), then write its committed file from it: cargo xtask write-schema \
             {event_type}",
            at(&places.schema_at),
        ),
        format!(
            "The fixture: give the payload of domain/fixtures/{} v{next}'s fields (a current \
             fixture must re-encode exactly).",
            fixture_file_name(event_type, next)
        ),
        format!("The docs: {readme}, the payload table's row of {event_type}."),
        format!(
            "When the caller chooses the value (no default): a field on {command}, read by \
             {payload}::from_command; then `cargo build --workspace --all-targets` names every \
             place that builds the command (the CLI, the HTTP body and its OpenAPI document, tests) \
             — each a caller choosing the value."
        ),
        format!(
            "Once v{next} is published: add {next} to \"{event_type}\" in domain/schemas/\
             {RELEASED_FILE}; from then on its schema may never change (until then it may, and \
             cargo xtask write-schema rewrites its file)."
        ),
        format!("Check the whole change: {CHECK}"),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn domain() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../domain")
    }

    #[test]
    fn every_place_of_an_order_event_is_found() {
        let source = Source::read(&domain()).expect("readable");
        let places = Places::find(&source, "order", "order.shipped", 1);
        assert_eq!(places.payload, "OrderShipped");
        assert_eq!(places.type_constant.as_deref(), Some("OrderEvent::SHIPPED"));
        for (what, found) in [
            ("payload", &places.payload_at),
            ("constructor", &places.constructor_at),
            ("version", &places.version_at),
            ("upcasters", &places.upcasters_at),
            ("steps", &places.steps_at),
            ("schema", &places.schema_at),
            ("values", &places.values_at),
        ] {
            assert!(found.is_some(), "{what} not found: {places:?}");
        }
        assert_eq!(
            places
                .command
                .as_ref()
                .map(|(name, at)| (name.as_str(), at.is_some())),
            Some(("ShipOrder", true))
        );
    }

    #[test]
    fn every_payload_type_is_built_by_its_constructor_alone() {
        // What makes "a new field with a default touches only the domain" true for every event
        // type, including ones added later: a non-exhaustive struct and its one constructor.
        let source = Source::read(&domain()).expect("readable");
        for kind in domain::AGGREGATES {
            for (event_type, current) in kind.events {
                let places = Places::find(&source, kind.name, event_type, *current);
                let declared = places
                    .payload_at
                    .unwrap_or_else(|| panic!("no pub struct {} for {event_type}", places.payload));
                let attributes: Vec<&str> = (1..declared.line)
                    .rev()
                    .map(|line| {
                        let at = Location {
                            file: declared.file.clone(),
                            line,
                        };
                        source.line(&at).unwrap_or("").trim()
                    })
                    .take_while(|l| l.starts_with("#[") || l.starts_with("///"))
                    .collect();
                assert!(
                    attributes.contains(&"#[non_exhaustive]"),
                    "{} ({declared}) must be #[non_exhaustive], so that only its constructor builds it",
                    places.payload
                );
                assert!(
                    places.constructor_at.is_some(),
                    "{} has no from_command beside it",
                    places.payload
                );
                assert!(
                    places.version_at.is_some(),
                    "{event_type}: no CURRENT_VERSIONS entry found"
                );
                assert!(
                    places.schema_at.is_some(),
                    "{event_type}: no schema titled v{current} found"
                );
                assert!(
                    places.upcasters_at.is_some(),
                    "{event_type}: no upcasters() found"
                );
            }
        }
    }

    #[test]
    fn a_customer_event_is_found_in_the_customer_module() {
        let source = Source::read(&domain()).expect("readable");
        let places = Places::find(&source, "customer", "customer.renamed", 1);
        let file = |found: &Option<Location>| found.as_ref().map(|l| l.file.clone());
        let customer = Some("domain/src/customer.rs".to_owned());
        assert_eq!(file(&places.payload_at), customer);
        assert_eq!(file(&places.constructor_at), customer);
        assert_eq!(file(&places.version_at), customer);
        assert_eq!(file(&places.upcasters_at), customer);
        assert_eq!(file(&places.schema_at), customer);
        assert_eq!(places.steps_at, None, "the customer has no upcast step yet");
        assert_eq!(
            places.type_constant.as_deref(),
            Some("CustomerEvent::RENAMED")
        );
    }
}

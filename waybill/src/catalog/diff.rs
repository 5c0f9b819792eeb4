//! What changed between two versions of a payload schema, field by field: `waybill schema diff`.
//!
//! A pure function of two JSON Schemas as the catalog writes them (`type: object` with `properties`,
//! `required` and `additionalProperties`, arrays with `items`). Each field is compared keyword by
//! keyword, so a change reads as what a consumer must care about — a field appeared, went, became
//! optional, got a tighter pattern — rather than as a text diff of two documents.

use std::collections::BTreeSet;

use serde::Serialize;
use serde_json::{Map, Value};

/// How a path changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ChangeKind {
    /// The field (or keyword) is only in the newer version.
    Added,
    /// The field (or keyword) is only in the older version.
    Removed,
    /// Both versions have it, differently.
    Changed,
}

impl ChangeKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Added => "added",
            Self::Removed => "removed",
            Self::Changed => "changed",
        }
    }
}

/// One difference between two schemas.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Change {
    /// The field: `customer_id`, `lines[].sku` (`[]` is every item of an array); empty for the payload
    /// itself.
    pub path: String,
    pub change: ChangeKind,
    /// The older version's side: the field's schema (removed), or the keyword's value (changed); `null`
    /// when it has none.
    pub from: Value,
    /// The newer version's side, as `from`.
    pub to: Value,
    /// What changed, in words: "required field added", "pattern changed", "now optional"…
    pub detail: String,
}

/// Every change from the schema `from` to the schema `to`, in path order (a field's own changes
/// before its nested fields').
pub(crate) fn diff(from: &Value, to: &Value) -> Vec<Change> {
    let mut changes = Vec::new();
    compare(&mut changes, "", from, to);
    changes
}

/// Keywords that are walked rather than compared as values.
const STRUCTURAL: [&str; 3] = ["properties", "required", "items"];

fn compare(changes: &mut Vec<Change>, path: &str, from: &Value, to: &Value) {
    let (Some(from), Some(to)) = (from.as_object(), to.as_object()) else {
        // `true`/`false` schemas, or anything else that is not an object: compared whole.
        if from != to {
            changes.push(Change {
                path: path.to_owned(),
                change: ChangeKind::Changed,
                from: from.clone(),
                to: to.clone(),
                detail: "schema changed".to_owned(),
            });
        }
        return;
    };
    compare_keywords(changes, path, from, to);
    compare_properties(changes, path, from, to);
    match (from.get("items"), to.get("items")) {
        (Some(a), Some(b)) => compare(changes, &format!("{path}[]"), a, b),
        (a, b) if a != b => changes.push(keyword_change(path, "items", a, b)),
        _ => {}
    }
}

/// The keywords of one schema node that are plain values: type, pattern, bounds, enum, format…
fn compare_keywords(
    changes: &mut Vec<Change>,
    path: &str,
    from: &Map<String, Value>,
    to: &Map<String, Value>,
) {
    let keywords: BTreeSet<&String> = from.keys().chain(to.keys()).collect();
    for keyword in keywords {
        // The payload's title names its version ("order.placed v2"): it differs between any two
        // versions by construction and says nothing about the shape.
        if STRUCTURAL.contains(&keyword.as_str()) || (path.is_empty() && keyword == "title") {
            continue;
        }
        let (a, b) = (from.get(keyword), to.get(keyword));
        if a != b {
            changes.push(keyword_change(path, keyword, a, b));
        }
    }
}

/// A keyword of a field that both versions have: the field changed, whether the keyword appeared,
/// went or took another value.
fn keyword_change(path: &str, keyword: &str, from: Option<&Value>, to: Option<&Value>) -> Change {
    let detail = match (from, to) {
        (None, _) => format!("{keyword} added"),
        (_, None) => format!("{keyword} removed"),
        _ => format!("{keyword} changed"),
    };
    Change {
        path: path.to_owned(),
        change: ChangeKind::Changed,
        from: from.cloned().unwrap_or(Value::Null),
        to: to.cloned().unwrap_or(Value::Null),
        detail,
    }
}

/// The fields of an object schema: added, removed, required-ness, then each common field recursively.
fn compare_properties(
    changes: &mut Vec<Change>,
    path: &str,
    from: &Map<String, Value>,
    to: &Map<String, Value>,
) {
    let empty = Map::new();
    let properties = |schema: &Map<String, Value>| -> Map<String, Value> {
        schema
            .get("properties")
            .and_then(Value::as_object)
            .unwrap_or(&empty)
            .clone()
    };
    let (old, new) = (properties(from), properties(to));
    let (old_required, new_required) = (required(from), required(to));
    let names: BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    for name in names {
        let field = if path.is_empty() {
            name.clone()
        } else {
            format!("{path}.{name}")
        };
        let (was, is) = (
            old_required.contains(name.as_str()),
            new_required.contains(name.as_str()),
        );
        match (old.get(name), new.get(name)) {
            (None, Some(schema)) => changes.push(Change {
                path: field,
                change: ChangeKind::Added,
                from: Value::Null,
                to: schema.clone(),
                detail: if is {
                    "required field added".to_owned()
                } else {
                    "optional field added".to_owned()
                },
            }),
            (Some(schema), None) => changes.push(Change {
                path: field,
                change: ChangeKind::Removed,
                from: schema.clone(),
                to: Value::Null,
                detail: if was {
                    "required field removed".to_owned()
                } else {
                    "optional field removed".to_owned()
                },
            }),
            (Some(a), Some(b)) => {
                if was != is {
                    let word = |required: bool| if required { "required" } else { "optional" };
                    changes.push(Change {
                        path: field.clone(),
                        change: ChangeKind::Changed,
                        from: Value::from(word(was)),
                        to: Value::from(word(is)),
                        detail: format!("now {}", word(is)),
                    });
                }
                compare(changes, &field, a, b);
            }
            (None, None) => {}
        }
    }
}

/// The names in a schema's `required` list.
fn required(schema: &Map<String, Value>) -> BTreeSet<&str> {
    schema
        .get("required")
        .and_then(Value::as_array)
        .map(|names| names.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// The widest value the text output shows; `--json` has them whole.
const SHOWN_VALUE: usize = 100;

/// The changes as lines for a terminal: a header, then one aligned line per change.
pub(crate) fn render(event_type: &str, from: i32, to: i32, changes: &[Change]) -> String {
    if changes.is_empty() {
        return format!("{event_type} v{from} → v{to}: no changes\n");
    }
    let shown = |path: &str| {
        if path.is_empty() {
            "(payload)".to_owned()
        } else {
            path.to_owned()
        }
    };
    let width = changes
        .iter()
        .map(|c| shown(&c.path).chars().count())
        .max()
        .unwrap_or(0)
        .max("PATH".len());
    let mut out = format!(
        "{event_type} v{from} → v{to}: {} change{}\n\n{:<7}  {:<width$}  DETAIL\n",
        changes.len(),
        if changes.len() == 1 { "" } else { "s" },
        "CHANGE",
        "PATH",
    );
    for change in changes {
        let values = match change.change {
            ChangeKind::Added => compact(&change.to),
            ChangeKind::Removed => compact(&change.from),
            ChangeKind::Changed => {
                format!("{} → {}", compact(&change.from), compact(&change.to))
            }
        };
        out.push_str(&format!(
            "{:<7}  {:<width$}  {}: {values}\n",
            change.change.as_str(),
            shown(&change.path),
            change.detail,
        ));
    }
    // What an upgrade costs: events written before a required field existed lack it.
    if from < to
        && changes
            .iter()
            .any(|c| c.change == ChangeKind::Added && c.detail.starts_with("required"))
    {
        out.push_str(&format!(
            "\nEvents stored as v{from} lack the required fields added: the upcaster to v{to} must supply them.\n"
        ));
    }
    out
}

/// One-line JSON, cut at [`SHOWN_VALUE`] characters; `(none)` for a side that does not exist.
fn compact(value: &Value) -> String {
    if value.is_null() {
        return "(none)".to_owned();
    }
    let text = value.to_string();
    if text.chars().count() <= SHOWN_VALUE {
        return text;
    }
    let cut: String = text.chars().take(SHOWN_VALUE).collect();
    format!("{cut}… (--json shows it whole)")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(required: &[&str], properties: Value) -> Value {
        json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "x v1",
            "type": "object",
            "additionalProperties": false,
            "required": required,
            "properties": properties,
        })
    }

    fn find<'a>(changes: &'a [Change], path: &str, detail: &str) -> &'a Change {
        changes
            .iter()
            .find(|c| c.path == path && c.detail.starts_with(detail))
            .unwrap_or_else(|| panic!("no {path:?} {detail:?} in {changes:#?}"))
    }

    #[test]
    fn identical_schemas_have_no_changes_and_the_title_is_not_one() {
        let a = object(&["x"], json!({"x": {"type": "string"}}));
        let mut b = a.clone();
        b["title"] = json!("x v2");
        assert_eq!(diff(&a, &a), []);
        assert_eq!(diff(&a, &b), []);
        assert_eq!(render("x", 1, 2, &[]), "x v1 → v2: no changes\n");
    }

    #[test]
    fn fields_added_removed_and_their_required_ness() {
        let a = object(
            &["gone", "stays"],
            json!({"gone": {"type": "string"}, "stays": {"type": "integer"}, "maybe": {"type": "string"}}),
        );
        let b = object(
            &["stays", "maybe", "new"],
            json!({"stays": {"type": "integer"}, "maybe": {"type": "string"}, "new": {"type": "string"}, "extra": {"type": "boolean"}}),
        );
        let changes = diff(&a, &b);
        let gone = find(&changes, "gone", "required field removed");
        assert_eq!(gone.change, ChangeKind::Removed);
        assert_eq!(gone.from, json!({"type": "string"}));
        assert_eq!(gone.to, Value::Null);
        let new = find(&changes, "new", "required field added");
        assert_eq!(new.change, ChangeKind::Added);
        assert_eq!(new.to, json!({"type": "string"}));
        assert_eq!(
            find(&changes, "extra", "optional field added").change,
            ChangeKind::Added
        );
        let maybe = find(&changes, "maybe", "now required");
        assert_eq!(
            (maybe.change, &maybe.from, &maybe.to),
            (ChangeKind::Changed, &json!("optional"), &json!("required"))
        );
        assert_eq!(changes.len(), 4, "{changes:#?}");
        // Path order, so the output reads the same on every run.
        let paths: Vec<&str> = changes.iter().map(|c| c.path.as_str()).collect();
        assert_eq!(paths, ["extra", "gone", "maybe", "new"]);
    }

    #[test]
    fn keywords_of_nested_fields_and_array_items() {
        let a = object(
            &["lines"],
            json!({
                "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "lines": {"type": "array", "maxItems": 500, "items": {
                    "type": "object", "required": ["sku"],
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]+$"},
                        "qty": {"type": "integer", "minimum": 1},
                    },
                }},
                "ref": {"type": "string"},
                "channel": {"type": "string", "enum": ["web", "shop"]},
            }),
        );
        let b = object(
            &["lines"],
            json!({
                "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "lines": {"type": "array", "maxItems": 100, "items": {
                    "type": "object", "required": ["sku", "qty"],
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z0-9-]+$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                        "note": {"type": "string"},
                    },
                }},
                "ref": {"type": ["string", "null"]},
                "channel": {"type": "string", "enum": ["web", "shop", "phone"]},
            }),
        );
        let changes = diff(&a, &b);
        let max_items = find(&changes, "lines", "maxItems changed");
        assert_eq!((&max_items.from, &max_items.to), (&json!(500), &json!(100)));
        let pattern = find(&changes, "lines[].sku", "pattern changed");
        assert_eq!(pattern.from, json!("^[A-Z]+$"));
        assert_eq!(pattern.to, json!("^[A-Z0-9-]+$"));
        find(&changes, "lines[].qty", "now required");
        let maximum = find(&changes, "lines[].qty", "maximum added");
        assert_eq!((&maximum.from, &maximum.to), (&Value::Null, &json!(99)));
        assert_eq!(
            find(&changes, "lines[].note", "optional field added").change,
            ChangeKind::Added
        );
        let r#type = find(&changes, "ref", "type changed");
        assert_eq!(r#type.to, json!(["string", "null"]));
        find(&changes, "channel", "enum changed");
        assert!(
            !changes.iter().any(|c| c.path == "currency"),
            "an unchanged field is not listed: {changes:#?}"
        );
        assert_eq!(changes.len(), 7, "{changes:#?}");
    }

    #[test]
    fn the_payload_s_own_keywords_have_the_empty_path() {
        let a = object(&[], json!({}));
        let mut b = a.clone();
        b["additionalProperties"] = json!(true);
        let changes = diff(&a, &b);
        assert_eq!(changes.len(), 1);
        assert_eq!(changes[0].path, "");
        assert_eq!(changes[0].detail, "additionalProperties changed");
        assert!(render("x", 1, 2, &changes).contains("(payload)"));
    }

    #[test]
    fn order_placed_v1_to_v2_lists_the_real_changes() {
        let schema =
            |v| domain::catalog::payload_schema("order.placed", v).expect("in the catalog");
        let changes = diff(&schema(1), &schema(2));
        for (path, kind) in [
            ("order_no", ChangeKind::Removed),
            ("amount_cents", ChangeKind::Removed),
            ("customer_id", ChangeKind::Added),
            ("currency", ChangeKind::Added),
            ("lines", ChangeKind::Added),
            ("total_cents", ChangeKind::Added),
        ] {
            assert!(
                changes.iter().any(|c| c.path == path && c.change == kind),
                "{path} {kind:?} is missing from {changes:#?}"
            );
        }
        let text = render("order.placed", 1, 2, &changes);
        assert!(
            text.starts_with("order.placed v1 → v2: 6 changes\n"),
            "{text}"
        );
        assert!(
            text.lines()
                .any(|l| l.starts_with("removed  order_no") && l.contains("required field removed")),
            "{text}"
        );
    }

    #[test]
    fn serialises_with_the_documented_keys() {
        let change = Change {
            path: "a".to_owned(),
            change: ChangeKind::Removed,
            from: json!({"type": "string"}),
            to: Value::Null,
            detail: "required field removed".to_owned(),
        };
        assert_eq!(
            serde_json::to_value(&change).expect("serialises"),
            json!({"path": "a", "change": "removed", "from": {"type": "string"}, "to": null, "detail": "required field removed"})
        );
    }
}

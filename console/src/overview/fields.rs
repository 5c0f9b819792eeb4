//! The overview's live values: each is rendered with the latest snapshot and carries its JSON path
//! (`data-k`) and format (`data-f`), so the script can refresh it from `/console/api/overview`; blocks
//! shown only while a value is truthy (`data-when`) or falsy (`data-unless`) likewise. The formats
//! here and in the script are the same.

use maud::{Markup, html};
use serde_json::Value;

use crate::html;

/// How a value is shown; the script has the same formats.
#[derive(Debug, Clone, Copy)]
pub(super) enum Format {
    Count,
    Rate,
    Age,
    Bytes,
    Text,
    Time,
}

impl Format {
    fn name(self) -> &'static str {
        match self {
            Self::Count => "count",
            Self::Rate => "rate",
            Self::Age => "age",
            Self::Bytes => "bytes",
            Self::Text => "text",
            Self::Time => "time",
        }
    }

    fn show(self, value: &Value) -> String {
        match (self, value) {
            (_, Value::Null) => "—".to_owned(),
            (Self::Count, v) => v.as_i64().map_or_else(|| v.to_string(), html::count),
            (Self::Rate, v) => format!("{:.1}/s", v.as_f64().unwrap_or(0.0)),
            (Self::Age, v) => html::age(v.as_f64().unwrap_or(0.0)),
            (Self::Bytes, v) => bytes(v.as_f64().unwrap_or(0.0)),
            // RFC 3339 in UTC: the time of day is what a live page needs.
            (Self::Time, Value::String(s)) => s
                .get(11..19)
                .map_or_else(|| s.clone(), |t| format!("{t} UTC")),
            (Self::Text, Value::String(s)) => s.clone(),
            (Self::Text | Self::Time, v) => v.to_string(),
        }
    }
}

fn bytes(n: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{value:.0} {}", UNITS[0])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// The JSON value at a dotted path (`snapshot.projections.0.applied`); `length` of an array is its
/// length, as in the script.
fn at(root: &Value, path: &str) -> Value {
    let mut here = root;
    for key in path.split('.') {
        if let (Value::Array(items), "length") = (here, key) {
            return Value::from(items.len());
        }
        here = match key.parse::<usize>() {
            Ok(i) => here.get(i),
            Err(_) => here.get(key),
        }
        .unwrap_or(&Value::Null);
    }
    here.clone()
}

/// The overview as JSON (the same paths the script reads), to render live values from.
#[derive(Debug)]
pub(super) struct Fields {
    root: Value,
}

impl Fields {
    /// Fields read from `overview` serialized as the API serializes it.
    pub(super) fn of(overview: &impl serde::Serialize) -> Self {
        Self {
            root: serde_json::to_value(overview).unwrap_or(Value::Null),
        }
    }

    /// A value the script keeps up to date.
    pub(super) fn field(&self, path: &str, format: Format) -> Markup {
        html! {
            span.v data-k=(path) data-f=(format.name()) { (html::text(&format.show(&at(&self.root, path)))) }
        }
    }

    fn truthy(&self, path: &str) -> bool {
        match &at(&self.root, path) {
            Value::Null | Value::Bool(false) => false,
            Value::Number(n) => n.as_f64() != Some(0.0),
            Value::String(s) => !s.is_empty(),
            _ => true,
        }
    }

    /// A row of a card: a label and a value.
    pub(super) fn row(&self, label: &str, path: &str, format: Format) -> Markup {
        html! { div.row { dt { (label) } dd { (self.field(path, format)) } } }
    }

    /// `inner`, shown while `path` is truthy.
    pub(super) fn when(&self, path: &str, inner: Markup) -> Markup {
        html! { div data-when=(path) hidden[!self.truthy(path)] { (inner) } }
    }

    /// `inner`, shown while `path` is falsy.
    pub(super) fn unless(&self, path: &str, inner: Markup) -> Markup {
        html! { div data-unless=(path) hidden[self.truthy(path)] { (inner) } }
    }

    /// The error at `path` as a red paragraph, shown only while there is one.
    pub(super) fn error(&self, path: &str) -> Markup {
        self.when(path, html! { p.error { (self.field(path, Format::Text)) } })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hidden_block_keeps_its_path_for_the_script() {
        let fields = Fields::of(&serde_json::json!({"a": {"found": false, "n": 1234}}));
        assert_eq!(
            fields.unless("a.found", html! { "absent" }).into_string(),
            "<div data-unless=\"a.found\">absent</div>"
        );
        assert_eq!(
            fields.when("a.found", html! { "here" }).into_string(),
            "<div data-when=\"a.found\" hidden>here</div>"
        );
        assert_eq!(
            fields.field("a.n", Format::Count).into_string(),
            "<span class=\"v\" data-k=\"a.n\" data-f=\"count\">1,234</span>"
        );
        assert_eq!(
            fields.field("a.missing.0", Format::Rate).into_string(),
            "<span class=\"v\" data-k=\"a.missing.0\" data-f=\"rate\">—</span>"
        );
    }
}

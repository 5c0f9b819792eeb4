//! The domain crate's Rust source read as a maintainer greps it: where an event type's payload,
//! constructor, version, upcasters, schema and command are, found by the names the code gives them
//! (`OrderShipped`, `impl Aggregate for Order`, `"order.shipped v1"`), so the checklist names the
//! right file and line for any event of any aggregate, wherever the code has moved to.

use std::fmt;
use std::path::Path;

use crate::XtaskError;
use crate::workspace::from_root;

/// A line of the source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The file, from the workspace root (`domain/src/event.rs`).
    pub file: String,
    /// Its 1-based line.
    pub line: usize,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file, self.line)
    }
}

#[derive(Debug)]
struct File {
    path: String,
    lines: Vec<String>,
}

/// Every `.rs` file under a domain folder's `src/`, in path order.
#[derive(Debug)]
pub struct Source {
    files: Vec<File>,
}

impl Source {
    /// Reads `domain_dir/src/**/*.rs` (none when there is no `src/`: then nothing is found).
    pub fn read(domain_dir: &Path) -> Result<Self, XtaskError> {
        let mut paths = Vec::new();
        let src = domain_dir.join("src");
        let mut folders = if src.is_dir() { vec![src] } else { Vec::new() };
        while let Some(folder) = folders.pop() {
            let read = |source| XtaskError::Read {
                path: folder.clone(),
                source,
            };
            for entry in std::fs::read_dir(&folder).map_err(read)? {
                let path = entry.map_err(read)?.path();
                if path.is_dir() {
                    folders.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    paths.push(path);
                }
            }
        }
        paths.sort();
        let files = paths
            .into_iter()
            .map(|path| {
                let text = std::fs::read_to_string(&path).map_err(|source| XtaskError::Read {
                    path: path.clone(),
                    source,
                })?;
                Ok(File {
                    path: from_root(domain_dir, &path),
                    lines: text.lines().map(str::to_owned).collect(),
                })
            })
            .collect::<Result<_, XtaskError>>()?;
        Ok(Self { files })
    }

    /// The first line, in any file, for which `matches` holds.
    pub fn find(&self, matches: impl Fn(&str) -> bool) -> Option<Location> {
        self.files.iter().find_map(|file| {
            let at = file.lines.iter().position(|l| matches(l))?;
            Some(Location {
                file: file.path.clone(),
                line: at + 1,
            })
        })
    }

    /// The first line after `from`, in its file, for which `matches` holds.
    pub fn find_after(&self, from: &Location, matches: impl Fn(&str) -> bool) -> Option<Location> {
        let file = self.files.iter().find(|f| f.path == from.file)?;
        let at = file.lines.iter().skip(from.line).position(|l| matches(l))?;
        Some(Location {
            file: file.path.clone(),
            line: from.line + at + 1,
        })
    }

    /// The text of the line at `at`.
    pub fn line(&self, at: &Location) -> Option<&str> {
        let file = self.files.iter().find(|f| f.path == at.file)?;
        file.lines.get(at.line.checked_sub(1)?).map(String::as_str)
    }
}

/// `order.placed` → `OrderPlaced`, `order` → `Order`: the Rust name the code gives a dotted or
/// snake-case name.
pub fn pascal(name: &str) -> String {
    name.split(['.', '_'])
        .map(|word| {
            let mut chars = word.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_uppercase().chain(chars).collect()
            })
        })
        .collect()
}

/// `order.shipped` → `order_shipped`: the prefix of its upcaster functions' names.
pub fn snake(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// The Rust module path of a source file: `domain/src/upcast.rs` → `domain::upcast`,
/// `domain/src/order/mod.rs` → `domain::order`, `domain/src/lib.rs` → `domain`.
pub fn module_path(file: &str) -> String {
    let mut parts: Vec<&str> = file.trim_end_matches(".rs").split('/').collect();
    if parts.len() > 1 && parts[1] == "src" {
        parts.remove(1);
    }
    if matches!(parts.last(), Some(&"mod") | Some(&"lib")) {
        parts.pop();
    }
    parts.join("::")
}

/// The name declared by `const NAME: … = "<value>";` on `line`, if that is what it holds.
pub fn const_named(line: &str, value: &str) -> Option<String> {
    if !line.contains(&format!("= \"{value}\";")) {
        return None;
    }
    let after = line.split("const ").nth(1)?;
    let name: String = after
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

/// The type a constructor reads, from its signature: `pub fn from_command(ship: &ShipOrder) -> Self`
/// → `ShipOrder` (the last segment of a path).
pub fn argument_type(signature: &str) -> Option<String> {
    let after = signature.split('&').nth(1)?;
    let path: String = after
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
        .collect();
    let name = path.rsplit("::").next()?;
    (!name.is_empty()).then(|| name.to_owned())
}

/// Whether `line` declares `pub struct <name>` (and not a longer name).
pub fn declares_struct(line: &str, name: &str) -> bool {
    let Some(rest) = line.trim_start().strip_prefix("pub struct ") else {
        return false;
    };
    rest.strip_prefix(name)
        .is_some_and(|after| !after.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_derived_as_the_code_spells_them() {
        assert_eq!(pascal("order.placed"), "OrderPlaced");
        assert_eq!(pascal("order.line_added"), "OrderLineAdded");
        assert_eq!(pascal("customer"), "Customer");
        assert_eq!(snake("customer.renamed"), "customer_renamed");
        assert_eq!(module_path("domain/src/upcast.rs"), "domain::upcast");
        assert_eq!(module_path("domain/src/order/mod.rs"), "domain::order");
        assert_eq!(
            module_path("domain/src/order/events.rs"),
            "domain::order::events"
        );
        assert_eq!(
            const_named(
                r#"    pub const SHIPPED: &'static str = "order.shipped";"#,
                "order.shipped"
            ),
            Some("SHIPPED".to_owned())
        );
        assert_eq!(
            const_named(r#"let x = "order.shipped";"#, "order.shipped"),
            None
        );
        assert_eq!(
            argument_type("    pub fn from_command(ship: &crate::order::ShipOrder) -> Self {"),
            Some("ShipOrder".to_owned())
        );
        assert_eq!(
            argument_type(
                "    pub fn from_command(place: &PlaceOrder, total_cents: i64) -> Self {"
            ),
            Some("PlaceOrder".to_owned())
        );
        assert!(declares_struct("pub struct OrderPaid {", "OrderPaid"));
        assert!(!declares_struct("pub struct OrderPaidTwice {", "OrderPaid"));
        assert!(!declares_struct("// pub struct OrderPaid", "OrderPaid"));
    }

    #[test]
    fn the_workspace_source_is_read_with_lines_from_one() {
        let domain = Path::new(env!("CARGO_MANIFEST_DIR")).join("../domain");
        let source = Source::read(&domain).expect("domain/src is readable");
        let at = source
            .find(|l| declares_struct(l, "OrderShipped"))
            .expect("OrderShipped is declared");
        assert!(at.file.starts_with("domain/src/"), "{at}");
        assert!(
            source
                .line(&at)
                .is_some_and(|l| l.contains("pub struct OrderShipped")),
            "{at}"
        );
        let next = source
            .find_after(&at, |l| l.contains("pub tracking_number"))
            .expect("its field follows");
        assert_eq!(next.file, at.file);
        assert!(next.line > at.line);
    }
}

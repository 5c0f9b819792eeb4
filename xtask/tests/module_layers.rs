//! The crates' modules depend on each other one way: in `projections`, `relay`, `store`, `waybill`,
//! `console`, `ops` and `lab`, no module reaches (through `crate::…` paths) a module that reaches it
//! back. A cycle is how "the runner is spread thin" started: six files calling each other both ways,
//! where a newcomer cannot tell which one owns a rule. `domain` is the exception named below, with its
//! reason.
//!
//! A module is a file directly under `src/` (or a folder with its `mod.rs`); what it uses is every
//! `crate::name` in its code outside comments and its `#[cfg(test)] mod tests`. Binaries under
//! `src/bin/` and the read models under `projections/src/models/` are left out: nothing uses them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crates checked, by folder.
const CRATES: [&str; 7] = [
    "projections",
    "relay",
    "store",
    "waybill",
    "console",
    "ops",
    "lab",
];

/// Not checked yet, with the reason: the domain's aggregate module is both the traits every
/// aggregate implements and the list of the aggregates this code knows, and `cargo xtask
/// new-version` edits `event.rs` and `upcast.rs` by their place; untangling them moves both.
const NOT_YET: [&str; 1] = ["domain"];

type Graph = BTreeMap<String, BTreeSet<String>>;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits in the workspace")
        .to_path_buf()
}

/// `text` without comments (line comments and doc comments) and without its unit-test module.
fn code_of(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    };
    text.lines()
        .map(|line| match line.find("//") {
            // A `//` inside a string (a URL) is not a comment; good enough for paths of modules,
            // which never follow a URL on the same line.
            Some(at) if !line[..at].contains('"') => &line[..at],
            _ => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The module names `code` reaches: `crate::name` and `use crate::{a, b::c}`.
fn uses(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            // Top-level names of the group: each item's first path segment.
            let mut depth = 0;
            let mut item_start = true;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        if !item.is_empty() {
                            found.insert(std::mem::take(&mut item));
                        }
                        item_start = true;
                        continue;
                    }
                    _ => {}
                }
                if item_start && depth == 0 && (c.is_ascii_alphanumeric() || c == '_') {
                    item.push(c);
                } else if c.is_whitespace() && item.is_empty() {
                    // Before the item's first letter.
                } else if !item.is_empty() {
                    found.insert(std::mem::take(&mut item));
                    item_start = false;
                }
            }
            if !item.is_empty() {
                found.insert(item);
            }
        } else {
            found.insert(ident(rest));
        }
    }
    found
}

/// The module graph of the crate whose sources are in `src`.
fn graph_of(src: &Path) -> Graph {
    let mut code: BTreeMap<String, String> = BTreeMap::new();
    let mut files = Vec::new();
    collect(src, &mut files);
    for file in files {
        let relative = file.strip_prefix(src).expect("below src");
        let first = relative
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .expect("a file name");
        if first == "bin" || first == "models" {
            continue;
        }
        let module = first.trim_end_matches(".rs").to_owned();
        let text = std::fs::read_to_string(&file).expect("a readable source file");
        code.entry(module).or_default().push_str(&code_of(&text));
    }
    let names: BTreeSet<String> = code.keys().cloned().collect();
    code.iter()
        .map(|(module, text)| {
            let reached = uses(text)
                .into_iter()
                .filter(|name| names.contains(name) && name != module)
                .collect();
            (module.clone(), reached)
        })
        .collect()
}

fn collect(dir: &Path, files: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a readable folder") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            collect(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

/// The cycles of `graph`: its strongly connected components of more than one module (Tarjan).
fn cycles(graph: &Graph) -> Vec<BTreeSet<String>> {
    struct Walk<'a> {
        graph: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<BTreeSet<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = BTreeSet::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    component.insert(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    self.found.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.found
}

#[test]
fn modules_depend_on_each_other_one_way() {
    let root = workspace();
    let mut problems = Vec::new();
    for krate in CRATES {
        let graph = graph_of(&root.join(krate).join("src"));
        assert!(
            graph.len() > 3,
            "{krate}: only {} modules read",
            graph.len()
        );
        for cycle in cycles(&graph) {
            let edges: Vec<String> = cycle
                .iter()
                .map(|m| {
                    let back: Vec<&String> = graph[m].intersection(&cycle).collect();
                    format!("{m} → {back:?}")
                })
                .collect();
            problems.push(format!("{krate}: {}", edges.join("; ")));
        }
    }
    assert!(
        problems.is_empty(),
        "modules that reach each other both ways:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_check_finds_a_cycle_and_reads_paths_as_rust_writes_them() {
    let code = "use crate::apply::{ApplyError, decide};\nuse crate::{held, park::{self, X}};\n\
                // crate::comment_only is not a use\nfn f() { crate::metrics::record(); }";
    let found = uses(&code_of(code));
    let expected: BTreeSet<String> = ["apply", "held", "park", "metrics"]
        .map(str::to_owned)
        .into();
    assert_eq!(found, expected);

    let graph: Graph = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(m, to)| (m.to_owned(), to.into_iter().map(str::to_owned).collect()))
    .collect();
    let found = cycles(&graph);
    assert_eq!(found.len(), 1);
    assert_eq!(
        found[0],
        ["a", "b", "c"].map(str::to_owned).into_iter().collect()
    );
}

#[test]
fn the_crate_left_out_still_has_its_cycle() {
    // When the domain is untangled, it joins CRATES and this test goes.
    for krate in NOT_YET {
        let graph = graph_of(&workspace().join(krate).join("src"));
        assert!(
            !cycles(&graph).is_empty(),
            "{krate} has no cycle any more: check it with the others (CRATES)"
        );
    }
}

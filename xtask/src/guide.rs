//! The guide's edits as data: the fenced blocks of a Markdown guide, with the section they stand in, and the `diff` blocks among them read as edits that can be applied to a copy of
//! the workspace. The guide shows its steps as code; a test carries them out from the same text, so
//! a step that no longer applies fails there instead of misleading a reader.
//!
//! An edit is a unified diff without line numbers: `--- a/<path>` and `+++ b/<path>` name the file,
//! each `@@ <label>` starts a hunk, and a hunk's lines are context (` `), removed (`-`) or added
//! (`+`); an empty line is an empty context line. A hunk applies where its context and removed
//! lines stand in the file exactly once.

use std::path::Path;

/// One fenced block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// The `##` or `###` heading it stands under, the nearest above ("" before the first).
    pub section: String,
    /// The fence's info string, e.g. `diff` or `sh step`.
    pub info: String,
    /// Its text, without the fences.
    pub text: String,
    /// The 1-based line of its opening fence.
    pub line: usize,
}

/// Every fenced block of `markdown`, in order.
pub fn blocks(markdown: &str) -> Vec<Block> {
    let mut found = Vec::new();
    let mut section = String::new();
    let mut open: Option<Block> = None;
    for (index, line) in markdown.lines().enumerate() {
        match &mut open {
            Some(block) if line.trim_start() == "```" => {
                found.push(block.clone());
                open = None;
            }
            Some(block) => {
                block.text.push_str(line);
                block.text.push('\n');
            }
            None => {
                if let Some(info) = line.trim_start().strip_prefix("```") {
                    open = Some(Block {
                        section: section.clone(),
                        info: info.trim().to_owned(),
                        text: String::new(),
                        line: index + 1,
                    });
                } else if let Some(heading) = line
                    .strip_prefix("### ")
                    .or_else(|| line.strip_prefix("## "))
                {
                    section = heading.trim().to_owned();
                }
            }
        }
    }
    found
}

/// One hunk: the lines it expects, and what they become.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hunk {
    /// The text after `@@`, for messages.
    pub label: String,
    /// Context and removed lines, in order.
    pub before: Vec<String>,
    /// Context and added lines, in order.
    pub after: Vec<String>,
}

/// The hunks for one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileEdit {
    /// The file, from the workspace root.
    pub path: String,
    /// Its hunks, applied in order.
    pub hunks: Vec<Hunk>,
}

/// Why an edit could not be read or applied.
#[derive(Debug, thiserror::Error)]
pub enum EditError {
    /// The diff does not have the shape described in this module.
    #[error("line {line} of the diff: {why}")]
    Malformed {
        /// The 1-based line in the block.
        line: usize,
        /// What is wrong.
        why: &'static str,
    },
    /// A hunk with neither context nor removed lines cannot be placed.
    #[error("{path}, hunk \"@@ {label}\": it needs context or removed lines to find its place")]
    Placeless {
        /// The file.
        path: String,
        /// The hunk's label.
        label: String,
    },
    /// The file to edit cannot be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A hunk's lines are not in the file, or stand there more than once.
    #[error(
        "{path}, hunk \"@@ {label}\": its context and removed lines stand {found} times in the \
         file, not once:\n{before}"
    )]
    NoSinglePlace {
        /// The file.
        path: String,
        /// The hunk's label.
        label: String,
        /// How often they were found.
        found: usize,
        /// The lines looked for.
        before: String,
    },
}

/// Reads a `diff` block's text as edits.
pub fn parse_diff(text: &str) -> Result<Vec<FileEdit>, EditError> {
    let mut edits: Vec<FileEdit> = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let malformed = |why| EditError::Malformed {
            line: index + 1,
            why,
        };
        if line.starts_with("--- ") {
            continue;
        }
        if let Some(path) = line.strip_prefix("+++ ") {
            let path = path.strip_prefix("b/").unwrap_or(path).trim().to_owned();
            edits.push(FileEdit {
                path,
                hunks: Vec::new(),
            });
            continue;
        }
        let edit = edits
            .last_mut()
            .ok_or_else(|| malformed("a diff starts with `--- a/<path>` and `+++ b/<path>`"))?;
        if let Some(label) = line.strip_prefix("@@") {
            edit.hunks.push(Hunk {
                label: label.trim().trim_end_matches("@@").trim().to_owned(),
                before: Vec::new(),
                after: Vec::new(),
            });
            continue;
        }
        let hunk = edit
            .hunks
            .last_mut()
            .ok_or_else(|| malformed("a hunk starts with `@@`"))?;
        let (mark, rest) = line.split_at(line.len().min(1));
        match mark {
            "" | " " => {
                hunk.before.push(rest.to_owned());
                hunk.after.push(rest.to_owned());
            }
            "-" => hunk.before.push(rest.to_owned()),
            "+" => hunk.after.push(rest.to_owned()),
            _ => return Err(malformed("a hunk's lines start with ' ', '-' or '+'")),
        }
    }
    for edit in &edits {
        if let Some(hunk) = edit.hunks.iter().find(|h| h.before.is_empty()) {
            return Err(EditError::Placeless {
                path: edit.path.clone(),
                label: hunk.label.clone(),
            });
        }
    }
    Ok(edits)
}

/// Applies `edit` to its file under `root`, every hunk or none.
pub fn apply(root: &Path, edit: &FileEdit) -> Result<(), EditError> {
    let path = root.join(&edit.path);
    let io = |source| EditError::Io {
        path: edit.path.clone(),
        source,
    };
    let text = std::fs::read_to_string(&path).map_err(io)?;
    let ends_with_newline = text.ends_with('\n');
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    for hunk in &edit.hunks {
        let places: Vec<usize> = (0..=lines.len().saturating_sub(hunk.before.len()))
            .filter(|&at| lines[at..].starts_with(&hunk.before))
            .collect();
        let [at] = places[..] else {
            return Err(EditError::NoSinglePlace {
                path: edit.path.clone(),
                label: hunk.label.clone(),
                found: places.len(),
                before: hunk.before.join("\n"),
            });
        };
        lines.splice(at..at + hunk.before.len(), hunk.after.iter().cloned());
    }
    let mut text = lines.join("\n");
    if ends_with_newline {
        text.push('\n');
    }
    std::fs::write(&path, text).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_carry_their_section_and_info() {
        let markdown = "# T\n\n```sh\nintro\n```\n\n### 1. First\n\ntext\n\n```diff\n--- a/x\n+++ b/x\n@@ f\n a\n+b\n```\n\n### 2. Second\n\n```sh step\ncargo xtask new-version order.shipped\n```\n\n## After\n\n```text\nx\n```\n";
        let found = blocks(markdown);
        assert_eq!(found.len(), 4);
        assert_eq!(
            found[3].section, "After",
            "a `##` heading ends a `###` section"
        );
        assert_eq!(
            (found[0].section.as_str(), found[0].info.as_str()),
            ("", "sh")
        );
        assert_eq!(found[1].section, "1. First");
        assert_eq!(found[1].text, "--- a/x\n+++ b/x\n@@ f\n a\n+b\n");
        assert_eq!(found[1].line, 11);
        assert_eq!(found[2].info, "sh step");
    }

    #[test]
    fn a_diff_applies_where_its_context_stands_once() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(
            dir.path().join("x.rs"),
            "fn a() {\n    one();\n}\n\nfn b() {}\n",
        )
        .expect("write");
        let edits = parse_diff(
            "--- a/x.rs\n+++ b/x.rs\n@@ fn a @@\n fn a() {\n-    one();\n+    two();\n+    three();\n }\n\n fn b() {}\n",
        )
        .expect("a diff");
        assert_eq!(edits.len(), 1);
        apply(dir.path(), &edits[0]).expect("applies");
        assert_eq!(
            std::fs::read_to_string(dir.path().join("x.rs")).expect("read"),
            "fn a() {\n    two();\n    three();\n}\n\nfn b() {}\n"
        );
        // Applied again, the removed line is gone: refused, and the file is left as it is.
        let error = apply(dir.path(), &edits[0]).expect_err("no longer applies");
        assert!(
            error
                .to_string()
                .contains("x.rs, hunk \"@@ fn a\": its context and removed lines stand 0 times"),
            "{error}"
        );
    }

    #[test]
    fn an_ambiguous_or_placeless_hunk_is_refused() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("x"), "a\nb\na\nb\n").expect("write");
        let edits = parse_diff("--- a/x\n+++ b/x\n@@\n a\n+c\n b\n").expect("a diff");
        let error = apply(dir.path(), &edits[0]).expect_err("twice");
        assert!(error.to_string().contains("stand 2 times"), "{error}");
        assert!(parse_diff("--- a/x\n+++ b/x\n@@\n+only added\n").is_err());
        assert!(parse_diff("@@\n a\n").is_err(), "no file");
        assert!(parse_diff("--- a/x\n+++ b/x\n a\n").is_err(), "no hunk");
        assert!(
            parse_diff("--- a/x\n+++ b/x\n@@\n*a\n").is_err(),
            "not a diff line"
        );
    }
}

//! Reading the book's Markdown sources: fenced code blocks, `{{#include}}` directives and
//! the files and anchors they point at.

use std::path::{Path, PathBuf};

/// One fenced code block of a chapter.
#[derive(Debug, Clone)]
pub(crate) struct Block {
    /// The chapter file.
    pub(crate) file: PathBuf,
    /// 1-based line of the opening fence.
    pub(crate) line: usize,
    /// The language (first word of the info string), e.g. `bash`.
    pub(crate) lang: String,
    /// The attributes after the language, e.g. `run`.
    pub(crate) attrs: Vec<String>,
    /// The text between the fences.
    pub(crate) body: String,
    /// The last non-empty line before the fence (for `<!-- norun: … -->`).
    pub(crate) before: String,
}

impl Block {
    /// `file:line`, for messages.
    pub(crate) fn at(&self) -> String {
        format!("{}:{}", self.file.display(), self.line)
    }
    /// Whether the block has attribute `a`.
    pub(crate) fn has(&self, a: &str) -> bool {
        self.attrs.iter().any(|x| x == a)
    }
}

/// The repository root.
pub(crate) fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `docs/book/src`.
pub(crate) fn src_dir() -> PathBuf {
    root().join("docs/book/src")
}

/// Every chapter, in the order SUMMARY.md lists them.
pub(crate) fn chapters() -> Vec<PathBuf> {
    let summary = std::fs::read_to_string(src_dir().join("SUMMARY.md")).expect("SUMMARY.md");
    summary
        .lines()
        .filter_map(|l| {
            let start = l.find("](")? + 2;
            let end = l[start..].find(')')? + start;
            Some(src_dir().join(&l[start..end]))
        })
        .collect()
}

/// The fenced code blocks of one chapter.
pub(crate) fn blocks(file: &Path) -> Vec<Block> {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let mut out = Vec::new();
    let mut open: Option<Block> = None;
    let mut before = String::new();
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        match &mut open {
            None if trimmed.starts_with("```") => {
                let info = trimmed.trim_start_matches('`');
                let mut parts = info.split(',').map(|s| s.trim().to_owned());
                open = Some(Block {
                    file: file.to_path_buf(),
                    line: n + 1,
                    lang: parts.next().unwrap_or_default(),
                    attrs: parts.collect(),
                    body: String::new(),
                    before: before.clone(),
                });
            }
            None => {
                if !line.trim().is_empty() {
                    before = line.trim().to_owned();
                }
            }
            Some(_) if trimmed.starts_with("```") => {
                out.extend(open.take());
                before.clear();
            }
            Some(b) => {
                b.body.push_str(line);
                b.body.push('\n');
            }
        }
    }
    assert!(open.is_none(), "{}: an unclosed code block", file.display());
    out
}

/// An `{{#include path[:anchor]}}` directive, resolved.
#[derive(Debug, Clone)]
pub(crate) struct Include {
    /// Where it is written (`file:line`).
    pub(crate) at: String,
    /// The included file.
    pub(crate) path: PathBuf,
    /// The anchor, when one is named.
    pub(crate) anchor: Option<String>,
}

/// Every include directive of a chapter (in code blocks or not).
pub(crate) fn includes(file: &Path) -> Vec<Include> {
    let text = std::fs::read_to_string(file).expect("chapter");
    let dir = file.parent().expect("a chapter has a directory");
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let mut rest = line;
        while let Some(start) = rest.find("{{#include ") {
            let after = &rest[start + "{{#include ".len()..];
            let end = after.find("}}").expect("include directive closes");
            let target = after[..end].trim();
            let (path, anchor) = match target.split_once(':') {
                Some((p, a)) => (p, Some(a.to_owned())),
                None => (target, None),
            };
            out.push(Include {
                at: format!("{}:{}", file.display(), n + 1),
                path: dir.join(path),
                anchor,
            });
            rest = &after[end..];
        }
    }
    out
}

/// Whether `text` holds the mdBook anchor `name` (`ANCHOR: name` … `ANCHOR_END: name`).
pub(crate) fn has_anchor(text: &str, name: &str) -> bool {
    let start = format!("ANCHOR: {name}");
    let end = format!("ANCHOR_END: {name}");
    let lines: Vec<&str> = text.lines().collect();
    let s = lines.iter().position(|l| l.trim_end().ends_with(&start));
    let e = lines.iter().position(|l| l.trim_end().ends_with(&end));
    matches!((s, e), (Some(s), Some(e)) if s < e)
}

/// The canonical form of a path, for comparing.
pub(crate) fn canonical(p: &Path) -> PathBuf {
    p.canonicalize()
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

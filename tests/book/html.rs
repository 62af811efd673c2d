//! Link checking of the built book: every internal link and `#anchor` resolves.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.html` file under `dir`.
fn html_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("build dir") {
        let p = entry.expect("entry").path();
        if p.is_dir() {
            html_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "html") {
            out.push(p);
        }
    }
}

/// The values of `attr="…"` in `html`.
fn attr_values<'a>(html: &'a str, attr: &str) -> Vec<&'a str> {
    let needle = format!(" {attr}=\"");
    html.match_indices(&needle)
        .filter_map(|(i, _)| {
            let rest = &html[i + needle.len()..];
            rest.find('"').map(|e| &rest[..e])
        })
        .collect()
}

/// Checks every internal `href` of the built book; returns the broken ones, each as
/// `page: href (why)`, and how many links were checked.
pub(crate) fn broken_links(build: &Path) -> (Vec<String>, usize) {
    let mut files = Vec::new();
    html_files(build, &mut files);
    let mut ids: BTreeMap<PathBuf, BTreeSet<String>> = BTreeMap::new();
    let mut texts = BTreeMap::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("html");
        ids.insert(
            f.clone(),
            attr_values(&text, "id")
                .into_iter()
                .chain(attr_values(&text, "name"))
                .map(str::to_owned)
                .collect(),
        );
        texts.insert(f.clone(), text);
    }
    let mut broken = Vec::new();
    let mut checked = 0;
    for (f, text) in &texts {
        for href in attr_values(text, "href") {
            if href.contains("://")
                || href.starts_with("mailto:")
                || href.starts_with("javascript:")
            {
                continue;
            }
            checked += 1;
            let (path, frag) = match href.split_once('#') {
                Some((p, fr)) => (p, Some(fr)),
                None => (href, None),
            };
            let target = if path.is_empty() {
                f.clone()
            } else if let Some(from_root) = path.strip_prefix('/') {
                // Relative to the site root (the 404 page's links).
                let t = build.join(from_root);
                if t.is_dir() { t.join("index.html") } else { t }
            } else {
                let t = f.parent().expect("dir").join(path);
                if t.is_dir() { t.join("index.html") } else { t }
            };
            let Ok(target) = target.canonicalize() else {
                broken.push(format!("{}: {href} (no such file)", f.display()));
                continue;
            };
            if let Some(frag) = frag.filter(|fr| !fr.is_empty()) {
                let known = ids
                    .iter()
                    .find(|(p, _)| p.canonicalize().ok().as_ref() == Some(&target))
                    .map(|(_, s)| s);
                match known {
                    Some(set) if set.contains(frag) => {}
                    Some(_) => broken.push(format!("{}: {href} (no such anchor)", f.display())),
                    None => {} // a link to a non-HTML file (a stylesheet, an image)
                }
            }
        }
    }
    (broken, checked)
}

//! Replays every kept fuzz input as an ordinary test: the seeds (`fuzz/seeds/<target>`),
//! the corpora the fuzzer grew (`fuzz/corpus/<target>`) and the inputs that once failed
//! (`fuzz/regressions/<target>`), each through the same `runner::fuzz` function its fuzz
//! target calls. A failure names the file. `scripts/fuzz` runs the fuzzer itself.

use std::path::{Path, PathBuf};

type Target = fn(&[u8]);

fn inputs(target: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut files = Vec::new();
    for set in ["seeds", "corpus", "regressions"] {
        let Ok(dir) = std::fs::read_dir(root.join(set).join(target)) else {
            continue;
        };
        files.extend(dir.map(|e| e.expect("readable corpus entry").path()));
    }
    files.sort();
    files
}

fn replay(name: &str, run: Target) {
    let files = inputs(name);
    assert!(!files.is_empty(), "no kept inputs for fuzz target {name}");
    for f in &files {
        // `scripts/fuzz` may be rewriting the corpus meanwhile: a file gone is skipped.
        let data = match std::fs::read(f) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => panic!("{}: {e}", f.display()),
        };
        if std::panic::catch_unwind(|| run(&data)).is_err() {
            panic!("fuzz target {name} fails on {}", f.display());
        }
    }
    eprintln!("fuzz target {name}: {} kept inputs replayed", files.len());
}

macro_rules! kept_inputs {
    ($($target:ident),*) => {$(
        #[test]
        fn $target() {
            replay(stringify!($target), runner::fuzz::$target);
        }
    )*};
}

kept_inputs!(
    envelope,
    manifest,
    expression,
    storage_codecs,
    effect_command
);

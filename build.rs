//! Records the git revision the binary is built from, for `runner --version` and `/info`.
use std::process::Command;

/// The trimmed output of `git <args>`, when git ran and said something.
fn git(args: &[&str]) -> Option<String> {
    Command::new("git")
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

fn main() {
    let rev = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".to_string());
    // Any tracked change makes the revision dirty (no output: clean, or no git).
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some();
    let rev = if dirty { format!("{rev}-dirty") } else { rev };
    println!("cargo:rustc-env=RUNNER_GIT_REV={rev}");
    // In a linked worktree `.git` is a file; its HEAD and index live in the worktree's own
    // git directory. Watching a path that does not exist would rebuild on every run.
    let git_dir = git(&["rev-parse", "--git-dir"]).unwrap_or_else(|| ".git".to_string());
    println!("cargo:rerun-if-changed={git_dir}/HEAD");
    println!("cargo:rerun-if-changed={git_dir}/index");
}

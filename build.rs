//! Build script: sets `LATCHKEY_COMMIT`, the short commit `latchkey --version` and
//! `latchkey_build_info` show.
//!
//! The commit is, in order: `git rev-parse --short=12 HEAD` when the package is the top level
//! of a git work tree (so a crate unpacked inside some other repository does not take that
//! repository's commit); else the `sha1` that `cargo package` records in
//! `.cargo_vcs_info.json` (a crates.io build), cut to 12 digits; else `unknown`. This script
//! never fails the build: a missing git, repository or file only gives `unknown`.
//!
//! It asks Cargo to run it again when `HEAD`, the branch refs or `packed-refs` change (those
//! of them that exist), so a new commit changes the version line without a clean build.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Hex digits of the commit shown.
const COMMIT_DIGITS: usize = 12;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let commit = git_commit(&manifest_dir)
        .or_else(|| packaged_commit(&manifest_dir))
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=LATCHKEY_COMMIT={commit}");
}

/// Runs `git -C dir ARGS` and returns its trimmed stdout when it succeeds.
fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let output = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    let text = String::from_utf8(output.stdout).ok()?;
    Some(text.trim().to_owned())
}

/// The commit of the work tree whose top level is `dir`, watching what would change it.
fn git_commit(dir: &Path) -> Option<String> {
    let top_level = git(dir, &["rev-parse", "--show-toplevel"])?;
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if !same(Path::new(&top_level), dir) {
        return None;
    }
    // `--git-dir` holds HEAD; the common dir holds the refs (they differ in a worktree).
    let git_dir = dir.join(git(dir, &["rev-parse", "--git-dir"])?);
    let common_dir = dir.join(git(dir, &["rev-parse", "--git-common-dir"])?);
    let watched = [
        git_dir.join("HEAD"),
        common_dir.join("refs").join("heads"),
        common_dir.join("packed-refs"),
    ];
    for path in watched.iter().filter(|path| path.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    let short = format!("--short={COMMIT_DIGITS}");
    let commit = git(dir, &["rev-parse", &short, "HEAD"])?;
    is_hex(&commit).then_some(commit)
}

/// The commit `cargo package` recorded: `"sha1": "<40 hex digits>"` in `.cargo_vcs_info.json`.
fn packaged_commit(dir: &Path) -> Option<String> {
    let path = dir.join(".cargo_vcs_info.json");
    // Only a path that exists: Cargo reruns the script on every build for a missing one.
    if !path.exists() {
        return None;
    }
    println!("cargo:rerun-if-changed={}", path.display());
    let text = std::fs::read_to_string(path).ok()?;
    let after = &text[text.find("\"sha1\"")? + "\"sha1\"".len()..];
    let value = after
        .trim_start()
        .strip_prefix(':')?
        .trim_start()
        .strip_prefix('"')?;
    let commit = value.get(..COMMIT_DIGITS)?;
    is_hex(commit).then(|| commit.to_owned())
}

fn is_hex(text: &str) -> bool {
    !text.is_empty() && text.bytes().all(|byte| byte.is_ascii_hexdigit())
}

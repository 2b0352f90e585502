//! docs/operations.md lists every setting: each flag and `LOOSELEAF_*` variable that
//! a service's `--help` shows is in it, so a flag added without its line fails here.

use std::process::Command;

use looseleaf_test_support::cluster::bin_dir_of;
use looseleaf_test_support::repo_root;

const SERVICES: &[&str] = &["looseleaf-store", "looseleaf-planner", "looseleaf-gpu-host", "looseleaf-frontend"];

#[test]
fn operations_doc_lists_every_flag_and_variable_of_every_service() -> anyhow::Result<()> {
    let doc = std::fs::read_to_string(repo_root().join("docs/operations.md"))?;
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let mut missing = Vec::new();
    for service in SERVICES {
        let help = Command::new(bin.join(service)).arg("--help").output()?;
        let help = String::from_utf8_lossy(&help.stdout);
        let words = help.split(|c: char| c.is_whitespace() || matches!(c, '[' | ']' | '=' | ',' | ':'));
        let settings: Vec<&str> = words
            .filter(|w| (w.starts_with("--") && w.len() > 2 && *w != "--help") || w.starts_with("LOOSELEAF_"))
            .collect();
        assert!(settings.contains(&"--nats-url"), "{service} --help: {help}");
        for s in settings {
            if !doc.contains(&format!("`{s}`")) {
                missing.push(format!("{service}: {s}"));
            }
        }
    }
    assert!(missing.is_empty(), "docs/operations.md lacks {missing:?}");
    Ok(())
}
